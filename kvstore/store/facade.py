"""The Store: the facade the daemon, the connector and the benchmarks use.

Tiers are ordered fastest first; the first (host RAM) takes every put synchronously, and
each replica tier (local disk, and the shared tiers) receives a copy written behind
(kvstore/store/write_behind.py). A read is served by the fastest tier holding the chunk that
has a fetch worker free, and verified (kvstore/store/read_path.py); a hit below the first tier
is promoted into it. Lookups answer from the index (kvstore/store/index.py, which draws a
chunk's life) and never do I/O.
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

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch

from kernels import parallel_copy
from kvstore.blob import HEADER_BYTES, BlobHeader, UnsealedBlob, decode_header, encode_header
from kvstore.codecs import Codec, get_codec, resolve_codec
from kvstore.config import StoreConfig
from kvstore.store.discovery import discover
from kvstore.store.eviction import Evictor
from kvstore.store.index import ChunkIndex, Entry, KeyLocks, Replica, StoreClosed
from kvstore.store.integrity import check_integrity
from kvstore.keys import ChunkKey
from kvstore.store.placement import Placement, planned_read_bytes_per_s
from kvstore.store.replication import TierOption, plan as replication_plan
from kvstore.policies import make_policy
from kvstore.store.quota import ReplicaUsage
from kvstore.store.read_path import ReadPath
from kvstore.store.recovery import recover
from kvstore.stats import StoreStats, TierStats
from kvstore.store.deletes import TierIO
from kvstore.store.tier_setup import SharedIndexClient, TierSetup, budgets, build_tiers
from kvstore.store.write_behind import Reservation, Ticket, WriteBehind
from tiers.base import Tier, TierError, TierFull, TierUnavailable

log = logging.getLogger(__name__)

__all__ = ["Store", "StoreClosed", "StoreStats", "TierStats"]


def _leading_header(parts):
    head = bytearray()
    for part in parts:
        head += memoryview(part).cast("B")[: HEADER_BYTES - len(head)]
        if len(head) == HEADER_BYTES:
            break
    return decode_header(head)


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
        self.first = self.tiers[0]
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
                                set(config.placement.tiers), lambda: self._write_behind.progressing(),
                                lambda: self._write_behind.shed_stalled(),
                                track_displaced=config.replication.mode == "utility")
        # reads in flight per tier (the disk's measured where not configured): for benchmarks and logs
        self.fetch_workers = fetch_workers = {s.tier.name: max(1, s.fetch_workers) for s in setups}
        self._fetch_pools = {n: ThreadPoolExecutor(w, thread_name_prefix=f"fetch-{n}") for n, w in fetch_workers.items()}
        self._readers = ThreadPoolExecutor(max(2, config.disk.read_threads), thread_name_prefix="store-read")
        self._prefetching: set[bytes] = set()
        self._reads = ReadPath(self.index, self._io, self.tiers, {s.tier.name: s.verify_payload for s in setups},
                               self._fetch_pools, fetch_workers, config.fetch_stall_s, self._promote)
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
        wb = config.write_behind
        parallel_copy.start()  # before the copy threads, whose lower priority threads they start inherit
        self._write_behind = WriteBehind(self.index, self._locks, self._io, self.first, self.replica_tiers, max_pending,
                                         wb.workers, wb.stall_s, self._evictor.make_room, self._evictor.write_codec,
                                         wb.nice, self._reads.corrupt)
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
        key.namespace.check(kv)
        chosen = resolve_codec(codec) if codec else self.codec
        kv = kv.detach().to("cpu").contiguous()
        payload = chosen.encode(kv)
        with self.index.lock:
            fresh = self.index.get(key.id) is None
        if not fresh:  # a re-put is recognised by its header, checksum included: pack it first
            header = encode_header(key, chosen.codec_id, kv.dtype, kv.shape, payload)
            self.put_blob(key, [header, payload], parent=parent.id if parent else None, durable=durable)
            return
        # a new chunk: the first tier checksums the payload as it copies it in (one pass)
        self._put(key.id, UnsealedBlob(key, chosen.codec_id, kv.dtype, kv.shape, payload), None,
                  parent.id if parent else None, durable, key.namespace.model_id)

    def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: bytes | None = None,
                 durable: bool = False) -> None:
        """Store an already encoded, already verified blob (header + payload, possibly in pieces).

        Putting the blob a chunk already holds is an access and writes nothing (retries are
        idempotent) but its copy again, behind, on a shared tier where a peer's blob replaced
        it; another blob of the same chunk (another codec) replaces it: reads then
        return the new one, and older copies on lower tiers are replaced behind. ``key`` is the
        chunk's key, or its id alone: then, until a put names its namespace, its model is
        unknown and placement keeps it lossless (codec verdicts hold per model)."""
        key_id, model_id = (key.id, key.namespace.model_id) if isinstance(key, ChunkKey) else (key, None)
        self._put(key_id, parts, _leading_header(parts), parent, durable, model_id)

    def _put(self, key_id: bytes, parts, header, parent: bytes | None, durable: bool, model_id: str | None) -> None:
        """``parts`` is a blob in pieces and ``header`` its header, or an ``UnsealedBlob``
        (``header`` None: it is known once the first tier has the blob)."""
        size = parts.size if header is None else sum(memoryview(p).nbytes for p in parts)
        ticket = Ticket() if durable else None
        while not self._put_once(key_id, parts, size, header, parent, ticket, model_id):
            pass  # the chunk changed while its copies' room was reserved: look again
        if ticket is not None:
            ticket.wait(self.config.write_behind.durable_timeout_s)

    def _put_once(self, key_id: bytes, parts, size: int, header, parent: bytes | None, ticket: Ticket | None,
                  model_id: str | None) -> bool:
        with self.index.lock:
            self.index.check_open()
            entry = self.index.get(key_id)
            if entry is not None and model_id is not None:  # a chunk put by id alone learns its model
                entry.model_id = model_id
            # an unsealed blob (header None) is a new one: put meanwhile by another caller, the
            # chunk gets a new version of the same bytes
            same = entry is not None and header is not None and entry.header == header
            host = entry.current(self.first.name) if same else None
            present = host is not None and host.size == size
            if present and ticket is None:  # an access; its copies on shared tiers are looked at behind
                self.index.puts += 1
                self.index.hit(key_id, entry)
                self._recheck(key_id, entry, size)
                return True
            needs = [t.name for t in self.replica_tiers
                     if not (same and WriteBehind.done_there(t, entry.known_current(t.name), ticket is not None))]
        reservation = self._write_behind.reserve(size, needs)
        if present:  # a durable put of what is there: its copies must be written and synced
            with self.index.lock:
                if self.index.get(key_id) is not entry or entry.current(self.first.name) is not host:
                    self._write_behind.release(reservation)
                    return False
                self.index.puts += 1
                self.index.hit(key_id, entry)
                self._write_behind.queue(key_id, entry, reservation, ticket)
            return True
        try:
            self._write_first(key_id, parts, size, True, None, lambda: self._commit_put(
                key_id, header or parts.header, size, parent, reservation, ticket, model_id))
        except BaseException:
            self._write_behind.release(reservation)
            raise
        return True

    def _recheck(self, key_id: bytes, entry: Entry, size: int) -> None:
        """Queue a look at the chunk's copy on each shared tier where the index lists one (a
        peer may have replaced it), where the queue has room now (index lock held): a plain put
        of what is there is an access and does not wait for write-behind."""
        rechecks = self._write_behind.rechecks(entry)
        if rechecks:
            room = self._write_behind.try_reserve(size, rechecks)
            if room.tiers:
                self._write_behind.queue(key_id, entry, room, None, list(room.tiers))

    def _commit_put(self, key_id: bytes, header, size: int, parent: bytes | None, reservation: Reservation,
                    ticket: Ticket | None, model_id: str | None) -> bool:
        """The index learns of a put's first-tier copy and queues its copies (index lock held)."""
        index = self.index
        index.puts += 1
        entry = index.get(key_id)
        if entry is None:
            entry = index.entries[key_id] = Entry(index.next_version(), size, header, parent=parent, model_id=model_id)
        else:
            index.hit(key_id, entry)
            if entry.header != header:  # another blob of the chunk: a new version
                entry.version, entry.size, entry.header = index.next_version(), size, header
            entry.parent = parent if parent is not None else entry.parent
            entry.model_id = model_id if model_id is not None else entry.model_id
        index.set_replica(key_id, entry, self.first.name, Replica.of(header, size, entry.version))
        index.stats[self.first.name].bytes_written += size
        # a durable put is a promise about every replica tier; a plain one gets the planned copies,
        # and looks at those on shared tiers where a peer may have replaced its blob
        only = None if ticket else self._planned_copies(key_id, entry)
        if only is not None:
            only += self._write_behind.rechecks(entry)
        self._write_behind.queue(key_id, entry, reservation, ticket, only)
        return True

    def _planned_copies(self, key_id: bytes, entry: Entry) -> list[str] | None:
        """The replica tiers that should get a copy of ``entry`` besides those that have one
        (index lock held): None for every one (``replication.mode = "all"``), else the
        replication planner's choice (kvstore/store/replication.py)."""
        if self.config.replication.mode == "all" or entry.header is None:
            return None
        stats, placement = self.index.stats, self.config.placement

        def bandwidth(name: str) -> float:
            return planned_read_bytes_per_s(placement, name, stats[name].read_gbps)

        have = {t.name: bandwidth(t.name) for t in self.replica_tiers if entry.current(t.name) is not None}
        options = [TierOption(t.name, bandwidth(t.name), t.footprint(entry.size),
                              t.capacity_bytes - t.used_bytes >= t.footprint(entry.size), self._evictor.displaced[t.name])
                   for t in self.replica_tiers if t.name not in have]
        reuse = self.index.policies[self.first.name].reuse_estimate(key_id)
        return replication_plan(reuse, entry.size, entry.header.shape[2] / placement.prefill_tokens_per_s, have, options)

    def _write_first(self, key_id: bytes, parts, size: int, wait: bool, precheck, commit) -> bool:
        """Write a blob into the first tier under its key lock, making room first (without the
        lock: eviction takes other keys' locks). ``precheck()`` (index lock held, before the
        write) may call it off; ``commit()`` (index lock held, right after it) says whether
        the value stays, else it is deleted before the key lock is released."""
        tier = self.first
        if self.placement is not None and not self.placement.profiled(*self._profile_key(parts)):
            self.placement.profile(*self._profile_key(parts))
        while True:
            self._evictor.make_room(tier, tier.footprint(size), exclude=key_id, wait=wait)
            with self._locks.hold(tier.name, key_id):
                with self.index.lock:
                    self.index.check_open()
                    if precheck is not None and not precheck():
                        return False
                try:
                    if isinstance(parts, UnsealedBlob):
                        tier.write_sealed(key_id, HEADER_BYTES, parts.payload, parts.restart(), parts.seal)
                    else:
                        tier.write(key_id, parts)
                except TierFull:
                    if not wait:
                        return False
                    continue  # another writer took the room meanwhile: make room again
                with self.index.lock:
                    keep = commit()
                if not keep:
                    self._io.delete_held(tier, key_id)
                return keep

    @staticmethod
    def _profile_key(parts):
        header = parts if isinstance(parts, UnsealedBlob) else _leading_header(parts)
        return header.dtype, header.shape

    def _promote(self, key_id: bytes, version: int, parts: list, size: int, header: BlobHeader) -> None:
        """Copy a chunk read from a lower tier into the first tier, unless it changed meanwhile
        (replaced, deleted: a deleted chunk never comes back, review #17) or the first tier
        has no room that is not pinned or waiting for copies."""
        if not self.config.promote_on_read:
            return

        def unchanged() -> bool:
            entry = self.index.get(key_id)
            return entry is not None and entry.version == version and entry.current(self.first.name) is None

        def commit() -> bool:
            if not unchanged():
                return False
            entry = self.index.get(key_id)
            self.index.set_replica(key_id, entry, self.first.name, Replica.of(header, size, version))
            self.index.stats[self.first.name].bytes_written += size
            more = self._planned_copies(key_id, entry)
            if more:  # read again from below: it may have earned more copies (never waited for)
                room = self._write_behind.try_reserve(entry.size, more)
                self._write_behind.queue(key_id, entry, room, None, list(room.tiers))
            return True

        with self.index.lock:
            if not unchanged():
                return
        try:
            self._write_first(key_id, parts, size, False, unchanged, commit)
        except TierError:
            pass  # the first tier is full of pinned or queued chunks: served without promoting

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
        key.namespace.check(out, "out")
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("out must be a contiguous CPU tensor")
        self.index.check_open()
        return self._reads.read(key, out) is not None

    def get_blob(self, key: ChunkKey) -> bytes | None:
        """The verified blob (header + encoded payload) of a chunk, or None on a miss."""
        self.index.check_open()
        return self._reads.read(key, None)

    def replicas(self, keys: Sequence[ChunkKey]) -> list[frozenset[str]]:
        """The tiers holding each of the leading present keys (index only)."""
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
        """Load the leading loadable chunks into ``outs`` (reused buffers); returns how many.
        Returns only when nothing writes into ``outs`` any more."""
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} buffers for {len(keys)} keys")
        arrived = list(self.stream(keys, outs=outs))  # the stream has closed: no read is left
        for out, chunk in zip(outs, arrived):
            if chunk is not out:
                out.copy_(chunk)
        return len(arrived)

    def pinned_payload(self, key: ChunkKey):
        """Where a chunk's tensor bytes lie in the first tier's pool, pinned for the ``with``
        block: (pool offset, length) ranges in order; None when they are not there as raw
        bytes (absent, or encoded: use ``get_into``). Read them with ``self.host_pool.views``.

        Why: the daemon sends these bytes to a socket, or tells a client that maps the pool
        where to copy them from, without a copy of its own. Verified like any read (the header
        always, the payload if the tier verifies payloads) and counted as a hit."""
        return self._reads.pinned_payload(self.first, self.host_pool, key)

    @contextmanager
    def borrow(self, key: ChunkKey) -> Iterator[torch.Tensor | None]:
        """The chunk as a tensor over its bytes in host RAM, for the ``with`` block only, when
        it lies there raw in one piece; else None (use ``get_into``). Verified and counted as
        a hit like any read. The caller only reads it: the pages are pinned, not copied.

        Why: a connector that scatters a chunk into its paged cache copies the bytes once,
        not twice (store to staging buffer, staging buffer to blocks)."""
        self.index.check_open()
        with self._reads.pinned_payload(self.first, self.host_pool, key, contiguous=True) as runs:
            if runs is None or runs[0][1] != key.namespace.chunk_bytes:
                yield None
                return
            (view,) = self.host_pool.views(runs)
            yield torch.frombuffer(view, dtype=key.namespace.torch_dtype).view(key.namespace.chunk_shape)

    # -- drop, delete ----------------------------------------------------------------------------

    def drop(self, keys: Sequence[ChunkKey], tier_name: str) -> int:
        """Remove one tier's copies of ``keys`` (other replicas stay), after their queued
        copies are done; returns how many were removed. A chunk whose copy still waits on a
        stalled tier keeps its copy here (the copy's source): before, the drop waited for it
        with no bound, and a hung tier held every quota eviction's thread."""
        tier = self.tier(tier_name)
        self._write_behind.wait_moving([k.id for k in keys])
        deletes = []
        with self.index.lock:
            for key in keys:
                entry = self.index.get(key.id)
                if entry is not None and tier_name in entry.replicas and not self._write_behind.busy(key.id):
                    self.index.remove_replica(key.id, entry, tier_name)
                    self._io.doom(tier_name, key.id)
                    deletes.append(key.id)
        for key_id in deletes:
            self._io.delete(tier, key_id)
        return len(deletes)

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks from every tier; returns how many were present. Returns once their
        files are gone and no copy of them is being written any more."""
        deletes = []
        present = 0
        with self.index.lock:
            self.index.check_open()
            for key in keys:
                entry = self.index.get(key.id)
                if entry is None:
                    continue
                present += entry.readable()
                tiers = set(self.index.pop(key.id)) | set(self._write_behind.cancel(key.id, entry))
                for name in tiers:
                    self._io.doom(name, key.id)
                deletes.append((key.id, tiers))
        failed = []
        removed: dict[str, list[bytes]] = {}
        for key_id, tiers in deletes:
            for name in tiers:
                error = self._io.delete(self._by_name[name], key_id)
                if error is not None:
                    failed.append(f"{name}: {key_id.hex()}: {error}")
                removed.setdefault(name, []).append(key_id)
        for name, key_ids in removed.items():  # a deleted chunk never comes back, not even after a power loss
            try:
                self._by_name[name].sync_deleted(key_ids)
            except TierError as exc:
                failed.append(f"{name}: syncing the deletes: {exc}")
        if failed:  # never "deleted" while a file of the chunk stays (it would come back at restart)
            raise TierUnavailable(f"delete: {len(failed)} copies could not be removed ({'; '.join(failed[:3])})")
        return present

    # -- stats, integrity, close -------------------------------------------------------------------

    def stats(self) -> StoreStats:
        with self.index.lock:
            now = time.monotonic()
            self.index.expire_pins(now)
            return StoreStats(
                tiers={t.name: TierStats(**{**self.index.stats[t.name].__dict__, "used_bytes": t.used_bytes, "chunks": len(t)})
                       for t in self.tiers},
                chunks=sum(1 for e in self.index.entries.values() if e.readable()),
                puts=self.index.puts,
                hits=self.index.hits,
                misses=self.index.misses,
                pinned=self.index.pinned_count(now),
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
            self.index.closed = True
            self.index.changed.notify_all()
        self._write_behind.close()
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
