"""The Store: the facade the daemon, the connector and the benchmarks use.

Tiers are ordered fastest first; the first (host RAM) takes every put synchronously
(kvstore/store/put_path.py), and each replica tier (local disk, and the shared tiers)
receives a copy written behind (kvstore/store/write_behind.py). A read is served by the
fastest tier holding the chunk that has a fetch worker free, and verified
(kvstore/store/read_path.py); a hit below the first tier is promoted into it. Lookups
answer from the index (kvstore/store/index.py, which draws a chunk's life) and never do I/O.
Each tier has its own eviction policy (kvstore/store/eviction.py; with placement, a victim may
stay re-encoded smaller). The parts share one index lock that is never held across tier
I/O, and one mutation lock per (tier, key) under which that value is written or deleted.

What the Store promises:
- A read returns the bytes of the last acknowledged put of that key, or a miss; never
  bytes of another version, another key or a damaged replica. A call returns only when
  nothing in the store will touch the caller's buffers again.
- A durable put returns only when its own copies are written and synced on every replica
  tier (fsync of file and directory on disk tiers); after a crash, such a chunk is there.
  Copies written behind without it are best effort: lost by a crash, never torn (damaged
  files are removed at start).
- A slow or hung tier slows its own copies and reads, never the other tiers' or lookups.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch

from kernels import parallel_copy
from kvstore.blob import BlobHeader, ClaimedBlob, SealedBlob
from kvstore.codecs import Codec, get_codec, resolve_codec
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey
from kvstore.policies import make_policy
from kvstore.wire.stats import StoreStats, TierStats
from kvstore.store.deletes import TierIO
from kvstore.store.discovery import discover
from kvstore.store.eviction import Evictor
from kvstore.store.index import ChunkIndex, KeyLocks, StoreClosed
from kvstore.store.integrity import check_integrity
from kvstore.store.owner_quota import OwnerQuotas
from kvstore.store.placement import Placement
from kvstore.store.put_path import PutPath
from kvstore.store.quota import ReplicaUsage
from kvstore.store.read_path import LentChunk, ReadPath
from kvstore.store.recovery import recover
from kvstore.store.removal import Removal
from kvstore.store.tier_setup import SharedIndexClient, TierSetup, budgets, build_tiers
from kvstore.store.write_behind import WriteBehind
from tiers.base import FirstTier, Tier

log = logging.getLogger(__name__)

__all__ = ["Store", "StoreClosed", "StoreStats", "TierStats"]


class Store:
    def __init__(self, config: StoreConfig | None = None, extra_tiers: Sequence[Tier] = (),
                 extra_fetch_workers: dict[str, int] | None = None, usage: ReplicaUsage | None = None) -> None:
        """``extra_tiers`` are appended after the configured ones (slower media, tests), with
        ``extra_fetch_workers[name]`` fetch workers each (default 4); ``usage`` is told of
        every replica recorded and removed (per-tenant quotas, kvstore/store/quota.py)."""
        self.config = config = config or StoreConfig()
        config.validate()
        setups = build_tiers(config) + [TierSetup(t, (extra_fetch_workers or {}).get(t.name, 4)) for t in extra_tiers]
        self.tiers: list[Tier] = [s.tier for s in setups]
        self.cluster = None
        try:
            if config.cluster.enabled:  # the shared tiers keep the cluster's budget (docs/cluster.md)
                from kvstore.cluster.member import ClusterMember

                self.cluster = ClusterMember(config, self._forget_shared)
                shared_budgets = budgets(config)
                for s in setups:
                    if s.tier.shared:
                        s.tier = self.cluster.wrap(s.tier, shared_budgets.get(s.tier.name, s.tier.capacity_bytes))
                self.tiers = [s.tier for s in setups]
            self._build(config, setups, usage)
            if self.cluster is not None:
                self.cluster.join()
        except BaseException:
            if self.cluster is not None:
                self.cluster.close()
            for tier in reversed(self.tiers):  # releases a data directory's lock, shared memory
                tier.close()
            raise

    def _build(self, config: StoreConfig, setups: list[TierSetup], usage: ReplicaUsage | None) -> None:
        """The parts in dependency order: each is handed only parts built before it."""
        first: FirstTier = self.tiers[0]  # host RAM: build_tiers puts it first
        self.first = first
        self._by_name = {t.name: t for t in self.tiers}
        if len(self._by_name) != len(self.tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in self.tiers]}")
        names = config.replicate_to if config.replicate_to is not None else [t.name for t in self.tiers[1:]]
        self.replica_tiers = [t for t in self.tiers[1:] if t.name in names]
        # unset: no cap of its own, since a queue's chunks are held in the first tier, whose room
        # bounds it; puts wait once that room would fill with them (kvstore/store/write_behind.py)
        max_pending = config.write_behind.max_pending_bytes or config.host.capacity_bytes
        if self.replica_tiers and max_pending > config.host.capacity_bytes:
            raise ValueError("write_behind.max_pending_bytes must be at most host.capacity_bytes")
        # the first tier's memory, where other processes or sockets can read it without a copy
        self.host_pool = self.first.shared_pool()
        self.codec = get_codec(config.codec)
        self.shared_tiers = [t for t in self.tiers if t.shared]
        self.shared_index = SharedIndexClient(config) if config.shared_index.enabled else None
        self.placement = Placement(config.placement) if config.placement.enabled else None
        if self.placement is not None and self.placement.inert:
            self.placement = None  # the default without a verdict file: no per-put work for nothing
        shared_named = [t.name for t in self.shared_tiers if t.name in config.placement.tiers]
        if self.placement is not None and shared_named:
            raise ValueError(f"placement.tiers names shared tiers {shared_named}; only private tiers are re-encoded")
        policies = {t.name: make_policy(config.eviction_policy, t.capacity_bytes) for t in self.tiers}
        self.index = ChunkIndex(policies, {t.name: t.capacity_bytes for t in self.tiers}, self.first.name,
                                {t.name: t.footprint for t in self.tiers}, usage)
        self._locks = KeyLocks()
        self._io = TierIO(self.index, self._locks, self.shared_index)
        self._evictor = Evictor(self.index, self._locks, self._io, self._by_name, self.placement,
                                set(config.placement.tiers), track_displaced=config.replication.mode == "utility")
        for tier in self.tiers[1:]:
            if not (tier.shared and self.shared_index is not None):  # with a shared index, found by lookups
                recover(self.index, tier)
                self._evictor.make_room(tier, 0, recode=False)
        if self.shared_index is not None and self.shared_tiers:
            # the shared copies of recovered chunks: lookups answered locally never ask for them,
            # and reads fetch from every replica (a restarted daemon would read its disk alone)
            recovered = list(self.index.entries)
            for i in range(0, len(recovered), 1024):
                discover(self.index, self.shared_tiers, self.shared_index, recovered[i:i + 1024], self._io)
        parallel_copy.start()  # before the copy threads, whose lower priority threads they start inherit
        self._write_behind = WriteBehind(self.index, self._locks, self._io, first, self.replica_tiers, self._evictor,
                                         config.write_behind, max_pending)
        self._removal = Removal(self.index, self._io, self._write_behind, self._by_name)
        quotas = OwnerQuotas(self.index, self.index.usage, self._removal, first.name)
        self._puts = PutPath(config, self.index, self._locks, self._io, first, self.replica_tiers, self._evictor,
                             self._write_behind, self.placement, quotas)
        # reads in flight per tier (the disk's measured where not configured): for benchmarks and logs
        self.fetch_workers = fetch_workers = {s.tier.name: max(1, s.fetch_workers) for s in setups}
        self._fetch_pools = {n: ThreadPoolExecutor(w, thread_name_prefix=f"fetch-{n}") for n, w in fetch_workers.items()}
        self._readers = ThreadPoolExecutor(max(2, config.disk.read_threads), thread_name_prefix="store-read")
        self._prefetching: set[bytes] = set()
        self._reads = ReadPath(self.index, self._io, self.tiers, {s.tier.name: s.verify_payload for s in setups},
                               self._fetch_pools, fetch_workers, config.fetch_stall_s, self._puts.promote,
                               config.blob_version)
        # whether ``lend`` hashes the payload it pins (else it touches only the index and the header)
        self.lend_hashes_payloads = self.host_pool is not None and setups[0].verify_payload
        log.info("store: %s", ", ".join(f"{t.name} {t.capacity_bytes / 2**30:.1f} GiB" for t in self.tiers))

    def _forget_shared(self, tier_name: str, key_ids: Sequence[bytes]) -> None:
        """Values a cluster's ledger had this daemon delete leave the lookup index too."""
        if self.shared_index is not None:
            self.shared_index.remove(tier_name, key_ids)

    def tier(self, name: str) -> Tier:
        try:
            return self._by_name[name]
        except KeyError:
            raise ValueError(f"unknown tier {name!r}; known: {sorted(self._by_name)}") from None

    # -- put ----------------------------------------------------------------------------------

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None, durable: bool = False,
            codec: "str | Codec | None" = None) -> None:
        """Store one chunk. Returns once it is in host RAM, or, if ``durable``, once it is also
        written and synced on every replica tier (raises if a copy failed or timed out).
        ``codec``: a registered name, or an instance of a registered codec (``resolve_codec``)."""
        self._puts.put(key, kv, parent, durable, resolve_codec(codec) if codec else self.codec)

    def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: bytes | None = None,
                 durable: bool = False, header: BlobHeader | None = None) -> None:
        """Store an already encoded, already verified blob (header + payload, possibly in pieces).

        Putting the blob a chunk already holds is an access and writes nothing (retries are
        idempotent) but its copy again, behind, on a shared tier where a peer's blob replaced
        it; another blob of the same chunk (another codec) replaces it: reads then
        return the new one, and older copies on lower tiers are replaced behind. ``key`` is the
        chunk's key, or its id alone: then, until a put names its namespace, its model is
        unknown and placement keeps it lossless (codec verdicts hold per model). ``header``:
        the blob's header, where the caller parsed it already (it is not parsed again)."""
        key_id, model_id = (key.id, key.namespace.model_id) if isinstance(key, ChunkKey) else (key, None)
        blob = SealedBlob(parts, header) if header is not None else SealedBlob.parse(parts)
        self._puts.put_blob(key_id, blob, parent, durable, model_id)

    def put_claimed(self, key: ChunkKey, head: bytes, header: BlobHeader, payload, *, parent: bytes | None = None,
                    durable: bool = False) -> None:
        """``put_blob`` of a blob whose header (``head``, parsed: ``header``) is verified and
        whose payload is only claimed to match it, in memory its sender may still change (a
        shared-memory slot): the first tier checksums its copy as it copies it in, and stores
        nothing unless that is the header's checksum (PayloadChecksumMismatch). One pass over
        the payload instead of a copy out of the sender's memory, a verifying pass and the
        put's copy."""
        self._puts.put_blob(key.id, ClaimedBlob(head, header, payload), parent, durable, key.namespace.model_id)

    # -- lookup, pin, prefetch ------------------------------------------------------------------

    def _first_missing(self, keys: Sequence[ChunkKey]) -> int:
        with self.index.lock:
            self.index.check_open()
            for i, key in enumerate(keys):
                entry = self.index.get(key.id)
                if entry is None or not entry.readable():
                    return i
            return len(keys)

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are stored in some tier. Answered from the index: the local
        one, then (for keys it lacks) the shared tiers' index; never chunk I/O."""
        i = self._first_missing(keys)
        if i < len(keys) and self.shared_tiers:
            discover(self.index, self.shared_tiers, self.shared_index, [k.id for k in keys[i:]], self._io)
            i += self._first_missing(keys[i:])
        return i

    def contains(self, key: ChunkKey) -> bool:
        return self.lookup([key]) == 1

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        """Keep present chunks from eviction in every tier for ``ttl_s`` seconds, at most
        ``max_pin_ttl_s`` (extends, never shortens, an earlier pin). Returns how many were present."""
        return self._pin(keys, ttl_s, leading=False)

    def pin_leading(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        """``lookup`` and ``pin`` in one step: pin the leading stored chunks of ``keys`` (up to
        the first missing one) as ``pin`` does; returns how many. They are found and pinned
        under one index lock, so none is evicted in between (a lookup then a pin had to look
        the keys up again when one was)."""
        if self.shared_tiers and (i := self._first_missing(keys)) < len(keys):
            discover(self.index, self.shared_tiers, self.shared_index, [k.id for k in keys[i:]], self._io)
        return self._pin(keys, ttl_s, leading=True)

    def _pin(self, keys: Sequence[ChunkKey], ttl_s: float, leading: bool) -> int:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        until = time.monotonic() + min(ttl_s, self.config.max_pin_ttl_s)
        pinned = []
        with self.index.lock:
            self.index.check_open()
            self.index.expire_pins()
            for key in keys:
                entry = self.index.get(key.id)
                if entry is not None and entry.readable():
                    self.index.pin(key.id, entry, until)
                    pinned.append(key.id)
                elif leading:
                    break
        if self.cluster is not None:  # other members must not evict them from the shared tiers
            self.cluster.pin(pinned, min(ttl_s, self.config.max_pin_ttl_s))
        return len(pinned)

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        """End pins early; returns how many of the keys were pinned."""
        with self.index.lock:
            self.index.check_open()
            self.index.expire_pins()
            ended = sum(self.index.unpin(k.id, e) for k in keys if (e := self.index.get(k.id)) is not None)
        if self.cluster is not None:
            self.cluster.unpin([k.id for k in keys])
        return ended

    def prefetch(self, keys: Sequence[ChunkKey]) -> list[Future]:
        """Start promoting chunks held only below the first tier; returns the futures of the
        reads started. A key already being prefetched is not read again, and at most
        ``prefetch_max_inflight`` prefetches run or wait at once (the rest are not started)."""
        with self.index.lock:
            self.index.check_open()
            todo = []
            for key in keys:
                entry = self.index.get(key.id)
                if entry is None or entry.current(self.first.name) is not None or key.id in self._prefetching:
                    continue
                if len(self._prefetching) >= self.config.prefetch_max_inflight:
                    break
                self._prefetching.add(key.id)
                todo.append(key)
        futures = []
        for key in todo:
            future = self._readers.submit(self.get_blob, key)
            # done also when cancelled before it ran (the daemon cancels a Prefetch RPC's
            # futures with the RPC): a finally inside the task never ran then, and the key
            # stayed counted as in flight for good
            future.add_done_callback(lambda _, key_id=key.id: self._prefetched(key_id))
            futures.append(future)
        return futures

    def _prefetched(self, key_id: bytes) -> None:
        with self.index.lock:
            self._prefetching.discard(key_id)

    # -- reads ------------------------------------------------------------------------------------

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Load a chunk into ``out`` (a contiguous CPU tensor of the chunk's shape and dtype).
        False on a miss; a corrupt or failing replica is skipped for the next one."""
        _check_out(key, out)
        self.index.check_open()
        return self._reads.copy_lent(self.first, [key], [out]) == 1 or self._reads.read(key, out) is not None

    def read_into(self, key: ChunkKey, take: Callable[[], torch.Tensor]) -> bool:
        """``get_into`` a tensor ``take()`` gives (a contiguous CPU tensor of the chunk's shape
        and dtype), called only once some tier holds the chunk; False on a miss, counted as
        any. Why: a daemon reads chunks a request merely names, and sizes nothing for one that
        does not exist, without asking the index first (a miss would then be two calls)."""
        self.index.check_open()

        def checked() -> torch.Tensor:
            out = take()
            _check_out(key, out)
            return out

        self._learn(key)
        return self._reads.read(key, checked) is not None

    def get_blob(self, key: ChunkKey) -> bytes | None:
        """The verified blob (header + encoded payload) of a chunk, or None on a miss (counted);
        a chunk a peer wrote on a shared tier is found as ``lookup`` finds it."""
        self.index.check_open()
        self._learn(key)
        return self._reads.read(key, None)

    def _learn(self, key: ChunkKey) -> None:
        """Index a chunk a peer wrote on a shared tier, if this store has none listed."""
        if self.shared_tiers:
            self.lookup([key])

    def replicas(self, keys: Sequence[ChunkKey]) -> list[frozenset[str]]:
        """The tiers holding each of the leading present keys (index only; a chunk a peer wrote
        on a shared tier is found as ``lookup`` finds it). Without shared tiers, no lookup: the
        caller (an engine's load) looked the keys up already."""
        self.index.check_open()
        if self.shared_tiers:
            self.lookup(keys)
        return self._reads.replicas(keys)

    def stream(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor] | None = None,
               tiers: Sequence[str] | None = None) -> Iterator[torch.Tensor]:
        """Free-tier fetch of the leading present chunks, yielded in order as they arrive.

        Each tier's workers take the earliest chunk their tier holds, so all tiers holding
        replicas read at once. ``outs`` are filled when given (a chunk taken over from a
        stalled tier, or read from a shared tier, arrives in a tensor of its own instead);
        ``tiers`` restricts the tiers used. Stops before the first chunk no replica can
        deliver, and returns only when no read writes into ``outs`` any more."""
        replicas = self.replicas(keys)
        if tiers is not None:
            allowed = set(tiers)
            unknown = allowed - set(self._by_name)
            if unknown:
                raise ValueError(f"unknown tiers {sorted(unknown)}; known: {sorted(self._by_name)}")
            replicas = [r & allowed for r in replicas]
            replicas = replicas[: next((i for i, r in enumerate(replicas) if not r), len(replicas))]
        n = len(replicas)
        if outs is None:
            outs = [torch.empty(k.namespace.chunk_shape, dtype=k.namespace.torch_dtype) for k in keys[:n]]
        else:
            for k, o in zip(keys, outs):
                k.namespace.check(o, "out")
        yield from self._reads.stream(keys, outs, replicas)

    def get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading chunks of ``keys`` that can be loaded, in order (stops at the first miss)."""
        return list(self.stream(keys))

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        """Load the leading loadable chunks into ``outs`` (reused buffers: contiguous CPU
        tensors of the chunks' shape and dtype); returns how many. Those that lie raw in host
        RAM are lent and copied together (``ReadPath.copy_lent``), the rest streamed. Returns
        only when nothing writes into ``outs`` any more."""
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} buffers for {len(keys)} keys")
        for key, out in zip(keys, outs):
            _check_out(key, out)
        self.index.check_open()
        done = self._reads.copy_lent(self.first, keys, outs)
        arrived = list(self.stream(keys[done:], outs=outs[done:]))  # the stream has closed: no read is left
        for out, chunk in zip(outs[done:], arrived):
            if chunk is not out:
                out.copy_(chunk)
        return done + len(arrived)

    def lend(self, key: ChunkKey) -> LentChunk | None:
        """The first phase of a two-phase read: where a chunk's tensor bytes lie in the first
        tier's pool, pinned until the caller calls ``release()`` on what this returns
        (``LentChunk``: read the ranges with ``self.host_pool.views``); None when they are not
        there as raw bytes (absent, or encoded: use ``get_into``). Verified like any read (the
        header always, the payload if the tier verifies payloads) and counted as a hit.

        Why: the daemon sends these bytes to a socket, or tells a client that maps the pool
        where to copy them from, and releases them once that is done, without a copy of its own."""
        self.index.check_open()
        return self._reads.lend(self.first, key)

    def lend_many(self, keys: Sequence[ChunkKey]) -> list[LentChunk]:
        """``lend`` of each leading key, up to the first that cannot be lent (absent, encoded,
        corrupt): for a Get of many chunks, at a fraction of the cost of a ``lend`` each."""
        self.index.check_open()
        return self._reads.lend_many(self.first, keys)

    @contextmanager
    def borrow(self, key: ChunkKey) -> Iterator[torch.Tensor | None]:
        """The chunk as a tensor over its bytes in host RAM, for the ``with`` block only, when
        it lies there raw in one piece; else None (use ``get_into``). Verified and counted as
        a hit like any read. The caller only reads it: the pages are pinned, not copied.

        Why: a connector that scatters a chunk into its paged cache copies the bytes once,
        not twice (store to staging buffer, staging buffer to blocks)."""
        self.index.check_open()
        lent = self._reads.lend(self.first, key, contiguous=True)
        if lent is None or lent.runs[0][1] != key.namespace.chunk_bytes:
            if lent is not None:
                lent.release()
            yield None
            return
        try:
            (view,) = self.host_pool.views(lent.runs)
            yield torch.frombuffer(view, dtype=key.namespace.torch_dtype).view(key.namespace.chunk_shape)
        finally:
            lent.release()

    def prepare_lending(self, device: torch.device | str) -> bool:
        """Make what ``borrow`` lends a source ``device`` copies from at the link's speed;
        whether it is. A CPU: always. A CUDA device: the host pool is registered with CUDA
        (page-locked until the store closes), once, so a borrowed chunk goes to the GPU by DMA
        with no staging copy; False where that fails (then copy through pinned buffers).

        Why: on an H200 borrowed llama-8b chunks reached a paged cache at 30-39 GB/s on one
        thread and 52-53 on two (the pinned-copy limit: 55), against 10-25 GB/s copied first
        into pinned staging buffers, and 6-8 GB/s borrowed unregistered (scripts/gpu_check.py)."""
        device = torch.device(device)
        if device.type == "cpu":
            return True
        return device.type == "cuda" and self.host_pool.register_with_cuda()

    # -- drop, delete ----------------------------------------------------------------------------

    def drop(self, keys: Sequence[ChunkKey], tier_name: str) -> int:
        """Remove one tier's copies of ``keys`` (other replicas stay), after their queued
        copies are done; returns how many were removed (kvstore/store/removal.py)."""
        self.tier(tier_name)
        return self._removal.drop([k.id for k in keys], tier_name)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks from every tier; returns how many were present. Returns once their
        files are gone and no copy of them is being written any more."""
        return self._removal.delete([k.id for k in keys])

    # -- stats, integrity, close -------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self.index.lock:
            index = self.index.snapshot()
            return StoreStats(
                tiers={t.name: dataclasses.replace(index.tiers[t.name], used_bytes=t.used_bytes, chunks=len(t))
                       for t in self.tiers},
                chunks=index.chunks,
                puts=index.puts,
                hits=index.hits,
                misses=index.misses,
                pinned=index.pinned,
                write_behind_pending_bytes=self._write_behind.pending_bytes(),
                write_behind_queue=self._write_behind.queued(),
                write_behind_dropped=self._write_behind.dropped,
                recode_failures=self._evictor.recode_failures,
            )

    def check_integrity(self) -> None:
        """Assert that index, tiers, policies, queues and pins agree (tests; call with no
        operation in flight)."""
        check_integrity(self.index, self._by_name, self._write_behind, self._locks, self._io)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued copy is written (or has failed); False on timeout."""
        return self._write_behind.wait_idle(timeout_s=timeout_s)

    def close(self) -> None:
        """Flush queued copies, stop the workers and release the tiers."""
        if self.index.closed:
            return
        self.flush()
        with self.index.lock:
            self.index.close()
        self._write_behind.close()
        if self.placement is not None:
            self.placement.close()
        self._readers.shutdown(wait=True)
        for pool in self._fetch_pools.values():
            pool.shutdown(wait=True)
        self._io.close()
        if self.cluster is not None:
            self.cluster.close()
        for tier in reversed(self.tiers):
            tier.close()
        if self.shared_index is not None:
            self.shared_index.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _check_out(key: ChunkKey, out: torch.Tensor) -> None:
    """A read's destination: a contiguous CPU tensor of the chunk's shape and dtype."""
    key.namespace.check(out, "out")
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("out must be a contiguous CPU tensor")
