"""The Store: the facade the daemon, the connector and the benchmarks use.

Tiers are ordered fastest first; the first (host RAM) takes every put synchronously, and
each replica tier (local disk, and later the shared tiers) receives a copy written behind
through its own queue and workers. While a chunk has copies queued its host pages cannot
be evicted, and a put waits while ``max_pending_bytes`` of chunks are queued
(backpressure: memory stays bounded). A read is served by the fastest tier holding the
chunk; a hit below the first tier is promoted into it. Lookups answer from the in-memory
index and never do I/O. Every blob read is verified; a corrupt replica is deleted, counted,
and the next replica is tried.

With placement enabled (kvstore/placement.py), a tier that needs room may keep its eviction
victim re-encoded smaller instead of dropping it; the index then records that copy's size
and codec, and readers decode it into their buffers as usual.

Each tier has its own eviction policy. A chunk is evictable from a tier unless it is pinned,
being re-encoded, or (first tier only) it still has copies queued; while it is held so, the
tier's policy does not track it (``on_remove``) but still hears of its hits, and takes it
back with the standing it had when the hold ends (``on_insert``: a hand-back).
Thread-safe: one lock guards the index, the policies and the counters; copies and tier
I/O run outside it.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
import xxhash

from kvstore.blob import (
    DTYPE_NAMES,
    HEADER_BYTES,
    BlobHeader,
    CorruptBlob,
    PayloadChecksumMismatch,
    decode_header,
    encode_header,
    payload_checksum,
    reencoded_header,
    verify_blob,
)
from kvstore.codecs import Codec, codec_by_id, get_codec
from kvstore.codecs.raw import tensor_bytes
from kvstore.config import StoreConfig
from kvstore.fetch import FetchJob
from kvstore.keys import ChunkKey
from kvstore.placement import Placement
from kvstore.quota import NO_USAGE, ReplicaUsage
from kvstore.stats import EWMA_ALPHA, StoreStats, TierStats
from kvstore.policies import make_policy
from tiers.base import SharedPool, Tier, TierError, TierFull
from kvstore.tier_setup import SharedIndexClient, TierSetup, build_tiers

log = logging.getLogger(__name__)


class StoreClosed(RuntimeError):
    pass


@dataclass
class _Entry:
    size: int  # blob bytes as put (the encoding write-behind copies)
    replicas: set[str] = field(default_factory=set)
    pending: int = 0  # queued copies to replica tiers
    pinned_until: float = 0.0
    parent: bytes | None = None  # the previous chunk's key id, for policies that use prefix structure
    waiters: list[threading.Event] = field(default_factory=list)
    copy_error: Exception | None = None
    header: BlobHeader | None = None  # the put blob's header, when it was written through this store
    encodings: dict[str, tuple[int, int]] = field(default_factory=dict)  # tier -> (size, codec id), re-encoded copies
    recoding: set[str] = field(default_factory=set)  # tiers re-encoding their copy now

    def size_in(self, tier_name: str) -> int:
        return self.encodings[tier_name][0] if tier_name in self.encodings else self.size

    def codec_in(self, tier_name: str) -> int | None:
        if tier_name in self.encodings:
            return self.encodings[tier_name][1]
        return None if self.header is None else self.header.codec_id


@dataclass
class _Recode:
    """A victim placement re-encodes in place: popped from its tier's policy, done outside the lock."""

    tier: Tier
    key_id: bytes
    entry: _Entry
    size: int  # the copy's size when planned
    codec: Codec


_REENCODED = object()  # a replica was re-encoded while being read: read it again


def _leading_header(parts) -> BlobHeader | None:
    """The header at the start of a blob given in pieces, or None if it is not one."""
    head = bytearray()
    for part in parts:
        head += memoryview(part).cast("B")[: HEADER_BYTES - len(head)]
        if len(head) == HEADER_BYTES:
            break
    try:
        return decode_header(head)
    except CorruptBlob:
        return None


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _split_runs(runs: list[tuple[int, int]], n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Byte ranges split after their first ``n`` bytes."""
    head: list[tuple[int, int]] = []
    for i, (offset, length) in enumerate(runs):
        if n <= 0:
            return head, runs[i:]
        if length <= n:
            head.append((offset, length))
            n -= length
            continue
        head.append((offset, n))
        return head, [(offset + n, length - n)] + runs[i + 1 :]
    return head, []


class Store:
    def __init__(
        self,
        config: StoreConfig | None = None,
        extra_tiers: Sequence[Tier] = (),
        extra_fetch_workers: dict[str, int] | None = None,
        usage: ReplicaUsage | None = None,
    ) -> None:
        """``extra_tiers`` are appended after the configured ones (slower media, tests), with
        ``extra_fetch_workers[name]`` fetch workers each (default 4)."""
        self.config = config = config or StoreConfig()
        self._usage = usage or NO_USAGE  # told of every replica recorded and removed (kvstore/quota.py)
        setups = build_tiers(config) + [
            TierSetup(t, (extra_fetch_workers or {}).get(t.name, 4)) for t in extra_tiers
        ]
        self.tiers: list[Tier] = [s.tier for s in setups]
        self.first = self.tiers[0]
        # the first tier's memory, where other processes or sockets can read it without a copy
        self.host_pool = self.first.shared_pool()
        self._by_name = {t.name: t for t in self.tiers}
        if len(self._by_name) != len(self.tiers):
            raise ValueError(f"tier names must be unique: {[t.name for t in self.tiers]}")
        if config.replicate_to is None:
            self.replica_tiers = self.tiers[1:]
        else:
            unknown = set(config.replicate_to) - {"gpu", "nvme", "pfs", "redis"} - set(self._by_name)
            if unknown:
                raise ValueError(f"replicate_to names unknown tiers {sorted(unknown)}")
            self.replica_tiers = [t for t in self.tiers[1:] if t.name in config.replicate_to]
        self.max_pending_bytes = config.write_behind.max_pending_bytes or config.host.capacity_bytes // 4
        if self.replica_tiers and self.max_pending_bytes > config.host.capacity_bytes // 2:
            raise ValueError("write_behind.max_pending_bytes must be at most half of host.capacity_bytes")
        self.codec = get_codec(config.codec)
        self._verify = {s.tier.name: s.verify_payload for s in setups}
        self.fetch_workers = {s.tier.name: max(1, s.fetch_workers) for s in setups}
        self.shared_tiers = [t for t in self.tiers if t.shared]
        self.shared_index = SharedIndexClient(config) if config.shared_index.enabled else None
        self.placement = Placement(config.placement) if config.placement.enabled else None
        shared_named = [t.name for t in self.shared_tiers if t.name in config.placement.tiers]
        if self.placement is not None and shared_named:
            raise ValueError(f"placement.tiers names shared tiers {shared_named}; only private tiers are re-encoded")
        self._placement_tiers = set(config.placement.tiers) if self.placement is not None else set()
        self._recode_failures = 0
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._index: dict[bytes, _Entry] = {}
        self._pins: list[tuple[float, bytes]] = []
        self._policies = {t.name: make_policy(config.eviction_policy, t.capacity_bytes) for t in self.tiers}
        self._stats = {t.name: TierStats(t.name, t.capacity_bytes) for t in self.tiers}
        self._puts = self._hits = self._misses = self._dropped = 0
        self._pending_bytes = 0
        self._closed = False
        self._queues: dict[str, queue.Queue] = {}
        self._workers: list[threading.Thread] = []
        self._index_updates: queue.Queue = queue.Queue()
        self._readers = ThreadPoolExecutor(max(2, config.disk.read_threads), thread_name_prefix="store-read")
        self._fetch_pools = {
            name: ThreadPoolExecutor(n, thread_name_prefix=f"fetch-{name}") for name, n in self.fetch_workers.items()
        }
        for tier in self.tiers[1:]:
            if not (tier.shared and self.shared_index is not None):
                self._recover(tier)  # with a shared index, shared tiers are found by lookups
        for tier in self.replica_tiers:
            self._queues[tier.name] = queue.Queue()
            for i in range(max(1, config.write_behind.workers)):
                self._start(self._copy_loop, f"copy-{tier.name}-{i}", tier)
        if self.shared_index is not None:
            self._start(self._index_loop, "shared-index")
        log.info(
            "store: %s",
            ", ".join(f"{t.name} {t.capacity_bytes / 2**30:.1f} GiB" for t in self.tiers),
        )

    def _start(self, target, name: str, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()
        self._workers.append(t)

    # -- recovery -----------------------------------------------------------------------------

    def _recover(self, tier: Tier) -> None:
        found = 0
        for key_id in tier.keys():
            size = tier.size_of(key_id)
            if size is None:
                continue
            entry = self._index.setdefault(key_id, _Entry(size=size))
            if entry.size != size:
                continue  # another tier holds a different encoding; keep the first seen
            entry.replicas.add(tier.name)
            self._usage.added(tier.name, key_id, size)
            self._sync_policies(key_id, entry)
            found += 1
        with self._lock:
            self._evict_to_fit(tier, 0, recode=False)
        if found:
            log.info("%s: recovered %d chunks (%d bytes)", tier.name, found, tier.used_bytes)

    # -- policy membership ------------------------------------------------------------------------

    def _evictable_from(self, tier_name: str, entry: _Entry) -> bool:
        if tier_name not in entry.replicas or tier_name in entry.recoding or entry.pinned_until > time.monotonic():
            return False
        return not (tier_name == self.first.name and entry.pending)

    def _sync_policies(self, key_id: bytes, entry: _Entry) -> None:
        """Make each tier's policy track the key exactly when it is evictable there (lock held).
        A held chunk leaves with ``on_remove`` and comes back with ``on_insert``, which policies
        treat as a hand-back, not an access (see kvstore/policies/base.py)."""
        for name, policy in self._policies.items():
            want = self._evictable_from(name, entry)
            if want and key_id not in policy:
                policy.on_insert(key_id, self._by_name[name].footprint(entry.size_in(name)), entry.parent)
            elif not want and key_id in policy:
                policy.on_remove(key_id, held=name in entry.replicas)
            elif name not in entry.replicas:  # gone from the tier, maybe while held: no hand-back is coming
                policy.on_remove(key_id, held=False)

    # -- validation ---------------------------------------------------------------------------

    @staticmethod
    def _check_chunk(key: ChunkKey, kv) -> None:
        ns = key.namespace
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"chunk must be a torch.Tensor, got {type(kv).__name__}")
        if DTYPE_NAMES.get(kv.dtype) != ns.dtype:
            raise ValueError(f"chunk dtype {kv.dtype} does not match namespace dtype {ns.dtype}")
        if tuple(kv.shape) != ns.chunk_shape:
            raise ValueError(f"chunk shape {tuple(kv.shape)} does not match namespace chunk shape {ns.chunk_shape}")

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("store is closed")

    # -- put ----------------------------------------------------------------------------------

    def put(
        self,
        key: ChunkKey,
        kv: torch.Tensor,
        *,
        parent: ChunkKey | None = None,
        durable: bool = False,
        codec: str | None = None,
    ) -> None:
        """Store one chunk. Returns once it is in host RAM, or in every replica tier if ``durable``."""
        self._check_chunk(key, kv)
        chosen = get_codec(codec) if codec else self.codec
        kv = kv.detach().to("cpu").contiguous()
        payload = chosen.encode(kv)
        header = encode_header(key, chosen.codec_id, kv.dtype, kv.shape, payload)
        self.put_blob(key.id, [header, payload], parent=parent.id if parent else None, durable=durable)

    def put_blob(self, key_id: bytes, parts: Sequence, *, parent: bytes | None = None, durable: bool = False) -> None:
        """Store an already encoded, already verified blob (header + payload, possibly in pieces).

        Putting a key that is already in host RAM with a blob of the same size is a no-op that
        keeps the stored bytes (keys name content, so the bytes are the same): retries are
        idempotent. The copy into host RAM runs outside the store lock.
        """
        size = sum(memoryview(p).nbytes for p in parts)
        waiter = threading.Event() if durable and self.replica_tiers else None
        with self._lock:
            self._check_open()
            self._puts += 1
            entry = self._index.get(key_id)
            present = entry is not None and self.first.name in entry.replicas and entry.size_in(self.first.name) == size
            if present:  # an access, even while the chunk is held out of the policy (pinned, copies queued)
                self._policies[self.first.name].on_hit(key_id)
            else:
                self._reserve_queue_room(size)
        reserved = 0 if present or not self.replica_tiers else size
        if not present:
            try:
                entry = self._write_first(key_id, parts, size, parent, replicate=reserved)
            except BaseException:
                self._release_reservation(reserved)
                raise
        with self._lock:
            if present:
                self._replicate(key_id, entry, 0)
            if waiter is not None:
                if entry.pending:
                    entry.waiters.append(waiter)
                else:
                    waiter.set()
        if waiter is not None:
            waiter.wait()
            if entry.copy_error is not None:
                raise entry.copy_error

    def _reserve_queue_room(self, size: int) -> None:
        """Backpressure: wait (releasing the lock) until the queues have room for ``size``
        bytes, then reserve them (lock held)."""
        if not self.replica_tiers:
            return
        while self._pending_bytes > 0 and self._pending_bytes + size > self.max_pending_bytes:
            self._changed.wait()
            self._check_open()
        self._pending_bytes += size

    def _release_reservation(self, size: int) -> None:
        if size:
            with self._lock:
                self._pending_bytes -= size
                self._changed.notify_all()

    def _write_first(
        self,
        key_id: bytes,
        parts,
        size: int,
        parent: bytes | None,
        wait: bool = True,
        encoding: tuple[int, int] | None = None,
        replicate: int | None = None,
    ) -> _Entry:
        """Copy a blob into the first tier, evicting as needed; call without the lock held.

        Eviction happens under the lock, the copy outside it; if another writer took the
        room meanwhile, evict again. ``wait=False`` gives up (TierFull) instead of waiting
        for queued copies to free room. ``encoding`` (size, codec id) marks a promoted copy
        that placement re-encoded: the same chunk, so the other copies stay. With
        ``replicate`` (the queue room reserved for it) the copies to the replica tiers are
        queued under the same lock as the write: the first tier's policy sees the put as an
        access, in put order, and the chunk leaves the policy until its copies are done
        without ever being evictable before they are queued.
        """
        tier = self.first
        header = _leading_header(parts)
        if self.placement is not None and header is not None and not self.placement.profiled(header.dtype, header.shape):
            self.placement.profile(header.dtype, header.shape)
        while True:
            self._make_room(tier, tier.footprint(size), exclude=key_id, wait=wait)
            try:
                tier.write(key_id, parts)
                break
            except TierFull:
                continue
        with self._lock:
            self._stats[tier.name].bytes_written += size
            entry = self._index.get(key_id)
            if entry is None:
                entry = self._index[key_id] = _Entry(size=size, header=header)
            elif encoding is not None:
                entry.encodings[tier.name] = encoding
            elif entry.size != size:
                for name in list(entry.replicas):  # re-encoded: other copies are stale
                    if name != tier.name:
                        self._drop_replica(key_id, entry, self._by_name[name])
                entry.size = size
                entry.header = header
                entry.encodings.clear()
            else:
                entry.encodings.pop(tier.name, None)
                entry.header = entry.header or header
            entry.replicas.add(tier.name)
            self._usage.added(tier.name, key_id, size)
            entry.parent = parent if parent is not None else entry.parent
            self._sync_policies(key_id, entry)
            if replicate is not None:
                self._replicate(key_id, entry, replicate)
            return entry

    def _replicate(self, key_id: bytes, entry: _Entry, reserved: int) -> None:
        """Queue copies to the replica tiers that lack the chunk, unless some are queued
        already (lock held); ``reserved`` bytes of queue room were counted for them."""
        missing = [t for t in self.replica_tiers if t.name not in entry.replicas]
        if missing and not entry.pending:
            self._queue_copies(key_id, entry, missing, reserved)
        elif reserved:
            self._release_reservation(reserved)

    def _queue_copies(self, key_id: bytes, entry: _Entry, tiers: list[Tier], reserved: int = 0) -> None:
        """Queue copies to ``tiers`` (lock held); ``reserved`` bytes were counted already."""
        entry.copy_error = None
        self._pending_bytes += entry.size - reserved
        entry.pending += len(tiers)
        self._sync_policies(key_id, entry)
        for tier in tiers:
            self._queues[tier.name].put((key_id, entry, entry.size))

    # -- eviction -------------------------------------------------------------------------------

    def _expire_pins(self) -> None:
        now = time.monotonic()
        while self._pins and self._pins[0][0] <= now:
            _, key_id = heapq.heappop(self._pins)
            entry = self._index.get(key_id)
            if entry is not None:
                self._sync_policies(key_id, entry)

    def _make_room(self, tier: Tier, need: int, exclude: bytes | None = None, wait: bool = True) -> None:
        """Evict from ``tier`` until ``need`` more bytes fit, re-encoding the victims placement
        keeps outside the lock; call without the lock held."""
        while True:
            with self._lock:
                job = self._evict_to_fit(tier, need, exclude=exclude, wait=wait)
            if job is None:
                return
            self._recode(job)

    def _evict_to_fit(
        self, tier: Tier, need: int, exclude: bytes | None = None, wait: bool = True, recode: bool = True
    ) -> _Recode | None:
        """Evict from ``tier`` until ``need`` more bytes fit (lock held); with ``wait``, wait
        for queued copies when only their chunks are left. With ``recode``, stops at the
        first victim placement would rather keep re-encoded and returns it (the caller
        re-encodes it outside the lock, then calls again)."""
        self._expire_pins()
        policy = self._policies[tier.name]
        while tier.capacity_bytes - tier.used_bytes < need:
            try:
                victim = policy.evict()
            except LookupError:
                if wait and tier is self.first and self._pending_bytes > 0:
                    self._changed.wait()  # everything evictable is waiting for its copies
                    self._expire_pins()
                    continue
                raise TierFull(f"{tier.name}: cannot make room for {need} bytes (the rest is pinned or in use)") from None
            if victim == exclude:
                continue
            entry = self._index.get(victim)
            job = self._plan_recode(tier, victim, entry) if recode and entry is not None else None
            if job is not None:
                entry.recoding.add(tier.name)
                return job
            self._stats[tier.name].evictions += 1
            if entry is None:
                self._delete_from(tier, victim)
            else:
                self._drop_replica(victim, entry, tier)
        return None

    # -- placement: re-encoding victims in place ---------------------------------------------------

    def _read_bytes_per_s(self, tier_name: str) -> float:
        gbps = self._stats[tier_name].read_gbps
        return gbps * 1e9 if gbps > 0 else float(self.config.placement.assumed_read_bytes_per_s)

    def _plan_recode(self, tier: Tier, key_id: bytes, entry: _Entry) -> _Recode | None:
        """The re-encoding placement wants for a victim just evicted from ``tier``, or None
        to drop it (lock held). Only chunks whose header this store has seen are planned."""
        header = entry.header
        if self.placement is None or tier.name not in self._placement_tiers or header is None:
            return None
        if not self.placement.profiled(header.dtype, header.shape) or (tier is self.first and entry.pending):
            return None
        reuse = self._policies[tier.name].reuse_estimate(key_id)
        if reuse <= 0:
            return None
        fallback_s = self.placement.recompute_s(header.shape)
        for name in entry.replicas - {tier.name}:
            fallback_s = min(fallback_s, self.placement.load_s(
                header.dtype, header.shape, entry.size_in(name), entry.codec_in(name), self._read_bytes_per_s(name)))
        size = entry.size_in(tier.name)
        choice = self.placement.choose(
            header.dtype, header.shape, size, reuse, fallback_s, self._read_bytes_per_s(tier.name), tier.footprint)
        return None if choice is None else _Recode(tier, key_id, entry, size, choice.codec)

    def _recode(self, job: _Recode) -> None:
        """Read, verify, decode and re-encode a victim outside the lock, then swap it in."""
        parts = None
        try:
            blob = job.tier.read(job.key_id)
            if blob is not None and len(blob) == job.size:
                header, payload = verify_blob(blob)
                tensor = codec_by_id(header.codec_id).decode(payload, header.shape, header.dtype)
                encoded = job.codec.encode(tensor)
                parts = [reencoded_header(header, job.codec.codec_id, encoded), encoded]
        except (CorruptBlob, TierError, OSError, ValueError, KeyError) as exc:
            log.warning("%s: re-encoding %s as %s failed: %s", job.tier.name, job.key_id.hex(), job.codec.name, exc)
        with self._lock:
            self._finish_recode(job, parts)

    def _finish_recode(self, job: _Recode, parts: list | None) -> None:
        """Swap the re-encoded copy in, or evict the victim as usual if that failed (lock held).
        A chunk changed meanwhile (deleted, replaced, copies queued) is left as it is."""
        tier, key_id, entry, name = job.tier, job.key_id, job.entry, job.tier.name
        entry.recoding.discard(name)
        if self._index.get(key_id) is not entry:
            return
        unchanged = name in entry.replicas and entry.size_in(name) == job.size and tier.size_of(key_id) == job.size
        if not unchanged or (tier is self.first and entry.pending):
            self._sync_policies(key_id, entry)
            return
        if parts is not None:
            size = sum(len(p) for p in parts)
            if tier.footprint(size) < tier.footprint(job.size) and self._replace(tier, key_id, parts):
                entry.encodings[name] = (size, job.codec.codec_id)
                self._usage.added(name, key_id, size)
                self._stats[name].recodes += 1
                self._stats[name].bytes_written += size
                if self._evictable_from(name, entry):
                    self._policies[name].reinstate(key_id, tier.footprint(size), entry.parent)
                self._sync_policies(key_id, entry)
                return
        self._recode_failures += 1
        self._stats[name].evictions += 1
        self._drop_replica(key_id, entry, tier)

    @staticmethod
    def _replace(tier: Tier, key_id: bytes, parts: list) -> bool:
        """Replace a value atomically; where the tier has no room for both copies at once (host
        pages), delete the old one first. False if the tier ends up without the new copy."""
        try:
            tier.write(key_id, parts)
            return True
        except TierFull:
            pass
        except TierError:
            return False
        try:
            tier.delete(key_id)
            tier.write(key_id, parts)
            return True
        except TierError:
            return False

    def _delete_from(self, tier: Tier, key_id: bytes) -> None:
        """Delete one copy; a tier that cannot be reached keeps it (counted, not raised)."""
        try:
            tier.delete(key_id)
            self._usage.removed(tier.name, key_id)
        except TierError as exc:
            self._stats[tier.name].errors += 1
            log.warning("%s: delete of %s failed: %s", tier.name, key_id.hex(), exc)
        if tier.shared and self.shared_index is not None:
            self._index_updates.put((tier.name, key_id))

    def _drop_replica(self, key_id: bytes, entry: _Entry, tier: Tier) -> None:
        """Remove one tier's copy; forget the chunk when no copy is left (lock held)."""
        self._delete_from(tier, key_id)
        entry.replicas.discard(tier.name)
        self._sync_policies(key_id, entry)
        if not entry.replicas and not entry.pending and self._index.get(key_id) is entry:
            del self._index[key_id]

    # -- write-behind ---------------------------------------------------------------------------

    def _copy_loop(self, tier: Tier) -> None:
        q = self._queues[tier.name]
        while True:
            item = q.get()
            if item is None:
                return
            self._copy(tier, *item)

    def _copy(self, tier: Tier, key_id: bytes, entry: _Entry, size: int) -> None:
        error: Exception | None = None
        written = False
        with self.first.pinned(key_id) as views:
            if views is not None and sum(len(v) for v in views) == size:
                try:
                    self._write_replica(tier, key_id, views, size)
                    written = True
                    if tier.shared and self.shared_index is not None:
                        self.shared_index.add(tier.name, [key_id], [size])  # visible before durable returns
                except (TierError, OSError) as exc:
                    error = exc
        with self._lock:
            entry.pending -= 1
            if entry.pending == 0:
                self._pending_bytes -= size
            current = self._index.get(key_id)
            if written and current is entry and entry.size == size:
                self._stats[tier.name].bytes_written += size
                entry.replicas.add(tier.name)
                self._usage.added(tier.name, key_id, size)
            elif written and current is None:
                self._delete_from(tier, key_id)  # deleted while queued
            elif error is not None:
                self._stats[tier.name].errors += 1
                self._dropped += 1
                entry.copy_error = error
                log.warning("%s: copy of %s failed: %s", tier.name, key_id.hex(), error)
            if current is entry:
                self._sync_policies(key_id, entry)
                if not entry.replicas and not entry.pending:
                    del self._index[key_id]
            if entry.pending == 0:
                for w in entry.waiters:
                    w.set()
                entry.waiters.clear()
            self._changed.notify_all()

    def _write_replica(self, tier: Tier, key_id: bytes, views, size: int) -> None:
        """Make room and write one copy. Room is made under the lock and the write happens
        outside it, so another copy worker may take the room meanwhile: then make room again
        (the tier now counts that worker's write) instead of dropping the copy. A TierFull
        while the tier's own count shows room is the medium's (file system full, Redis out of
        memory): raised, not retried."""
        need = tier.footprint(size)
        while True:
            self._make_room(tier, need, exclude=key_id)
            try:
                tier.write(key_id, views)
                return
            except TierFull:
                if tier.capacity_bytes - tier.used_bytes >= need:
                    raise

    def _index_loop(self) -> None:
        """Apply shared-index removals in the background (they happen under the store lock)."""
        while True:
            item = self._index_updates.get()
            if item is None:
                return
            tier_name, key_id = item
            self.shared_index.remove(tier_name, [key_id])

    def flush(self) -> None:
        """Wait until every queued copy is written (or has failed)."""
        with self._lock:
            while self._pending_bytes > 0:
                self._changed.wait()

    # -- lookup, pin, prefetch ------------------------------------------------------------------

    def _first_missing(self, keys: Sequence[ChunkKey]) -> int:
        with self._lock:
            for i, key in enumerate(keys):
                if key.id not in self._index:
                    return i
            return len(keys)

    def _discover(self, keys: Sequence[ChunkKey]) -> None:
        """Find chunks other daemons put in the shared tiers, for keys this index lacks.

        With a shared index this is one Redis round trip; without, one existence check per
        key and shared tier, stopping at the first key no shared tier holds.
        """
        if not self.shared_tiers or not keys:
            return
        ids = [k.id for k in keys]
        found: dict[bytes, dict[str, int]] = {}
        if self.shared_index is not None:
            names = {t.name for t in self.shared_tiers}
            for key_id, where in self.shared_index.lookup(ids).items():
                where = {n: size for n, size in where.items() if n in names}
                if where:
                    found[key_id] = where
        else:
            for key_id in ids:
                where = {}
                for tier in self.shared_tiers:
                    try:
                        size = tier.size_of(key_id)
                    except TierError:
                        size = None
                    if size is not None:
                        where[tier.name] = size
                if not where:
                    break
                found[key_id] = where
        if not found:
            return
        with self._lock:
            for key_id, where in found.items():
                entry = self._index.get(key_id)
                for name, size in where.items():
                    if entry is None:
                        entry = self._index[key_id] = _Entry(size=size)
                    if size == entry.size:
                        entry.replicas.add(name)
                if entry is not None:
                    self._sync_policies(key_id, entry)

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are stored in some tier. Answered from the index: the
        local one, then (for keys it lacks) the shared tiers' index; never chunk I/O."""
        i = self._first_missing(keys)
        if i < len(keys) and self.shared_tiers:
            self._discover(keys[i:])
            i += self._first_missing(keys[i:])
        return i

    def contains(self, key: ChunkKey) -> bool:
        return self.lookup([key]) == 1

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        """Keep present chunks from eviction in every tier for ``ttl_s`` seconds (extends,
        never shortens, an earlier pin). Returns how many were present."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        until = time.monotonic() + ttl_s
        pinned = 0
        with self._lock:
            for key in keys:
                entry = self._index.get(key.id)
                if entry is None:
                    continue
                pinned += 1
                if until > entry.pinned_until:
                    entry.pinned_until = until
                    heapq.heappush(self._pins, (until, key.id))
                self._sync_policies(key.id, entry)
        return pinned

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        """End pins early; returns how many of the keys were pinned."""
        now = time.monotonic()
        count = 0
        with self._lock:
            for key in keys:
                entry = self._index.get(key.id)
                if entry is not None and entry.pinned_until > now:
                    entry.pinned_until = 0.0
                    self._sync_policies(key.id, entry)
                    count += 1
        return count

    def prefetch(self, keys: Sequence[ChunkKey]) -> list[Future]:
        """Start promoting chunks held only below the first tier; returns the futures."""
        with self._lock:
            todo = [k for k in keys if (e := self._index.get(k.id)) is not None and self.first.name not in e.replicas]
        return [self._readers.submit(self.get_blob, k) for k in todo]

    # -- reads ------------------------------------------------------------------------------------

    def _tiers_holding(self, key_id: bytes) -> list[Tier]:
        with self._lock:
            entry = self._index.get(key_id)
            return [] if entry is None else [t for t in self.tiers if t.name in entry.replicas]

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Load a chunk into ``out`` (a contiguous CPU tensor of the chunk's shape and dtype).

        Returns False on a miss; a corrupt or failing replica is skipped for the next one.
        """
        self._check_chunk(key, out)
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("out must be a contiguous CPU tensor")
        return self._read(key, out) is not None

    def get_blob(self, key: ChunkKey) -> bytes | None:
        """The verified blob (header + encoded payload) of a chunk, or None on a miss."""
        return self._read(key, None)

    def read_from(self, tier_name: str, key: ChunkKey, out: torch.Tensor | None) -> bytes | bool:
        """Read one chunk from one named tier (for fetchers that pick the tier themselves).

        Returns True (``out`` filled) or the blob (``out`` None); False on a miss there.
        Raises CorruptBlob or TierError; the caller decides what to do next.
        """
        result = self._read_tier(self._by_name[tier_name], key, out)
        return False if result is None else result

    def _read(self, key: ChunkKey, out: torch.Tensor | None):
        key_id = key.id
        for tier in self._tiers_holding(key_id):
            try:
                result = self._read_tier(tier, key, out)
            except CorruptBlob as exc:
                self._on_corrupt(key_id, tier, exc)
                continue
            except TierError as exc:
                with self._lock:
                    self._stats[tier.name].errors += 1
                log.warning("%s: read of %s failed: %s", tier.name, key, exc)
                continue
            if result is not None:
                return result
        with self._lock:
            self._misses += 1
            for name, policy in self._policies.items():
                policy.on_miss(key_id)
                self._stats[name].misses += 1
        return None

    def _read_tier(self, tier: Tier, key: ChunkKey, out: torch.Tensor | None):
        """Read and verify one replica; True/blob bytes on success, None if it vanished. A
        replica placement re-encoded while it was being read is read again."""
        for _ in range(2):
            result = self._read_tier_once(tier, key, out)
            if result is not _REENCODED:
                return result
        return None

    def _read_tier_once(self, tier: Tier, key: ChunkKey, out: torch.Tensor | None):
        key_id = key.id
        size = tier.size_of(key_id)
        if size is None:
            return self._vanished(key_id, tier)
        header_buf = bytearray(HEADER_BYTES)
        direct = out is not None and size == HEADER_BYTES + out.numel() * out.element_size()
        payload_buf = tensor_bytes(out) if direct else memoryview(bytearray(max(size - HEADER_BYTES, 0)))
        started = time.perf_counter()
        try:
            got = tier.read_into(key_id, [memoryview(header_buf), payload_buf])
        except ValueError:
            return self._vanished(key_id, tier)  # replaced by a larger value meanwhile
        elapsed = time.perf_counter() - started
        if got is None:
            return self._vanished(key_id, tier)
        if got != size:
            if tier.size_of(key_id) != size:
                return self._vanished(key_id, tier)  # replaced meanwhile (another daemon)
            raise CorruptBlob(f"{tier.name}: read {got} bytes, expected {size}")
        header = self._checked_header(tier, key, header_buf, size)
        if self._verify[tier.name] and payload_checksum(payload_buf) != header.payload_checksum:
            raise PayloadChecksumMismatch(f"{tier.name}: payload checksum mismatch")
        if out is not None and not (direct and header.codec_id == 0):
            codec_by_id(header.codec_id).decode_into(payload_buf, out)
        self._on_hit(key_id, tier, size, elapsed, header.codec_id, header_buf, payload_buf)
        return True if out is not None else bytes(header_buf) + bytes(payload_buf)

    @staticmethod
    def _checked_header(tier: Tier, key: ChunkKey, header_buf, size: int) -> BlobHeader:
        """The header of a ``size``-byte blob read for ``key``; CorruptBlob if it does not fit."""
        header = decode_header(header_buf)
        if header.key_id != key.id:
            raise CorruptBlob(f"{tier.name}: blob names another key")
        if header.dtype != _torch_dtype(key.namespace.dtype) or header.shape != key.namespace.chunk_shape:
            raise CorruptBlob(f"{tier.name}: blob holds {header.dtype}{list(header.shape)}")
        if header.payload_len != size - HEADER_BYTES:
            raise CorruptBlob(f"{tier.name}: payload length {header.payload_len} != {size - HEADER_BYTES}")
        return header

    @contextmanager
    def pinned_payload(self, key: ChunkKey) -> Iterator[list[tuple[int, int]] | None]:
        """Where a chunk's tensor bytes lie in the first tier's pool, pinned for the ``with``
        block: (pool offset, length) ranges in order; None when they are not there as raw
        bytes (absent, or encoded: use ``get_into``). Read them with ``self.host_pool.views``.

        Why: the daemon sends these bytes to a socket, or tells a client that maps the pool
        where to copy them from, without a copy of its own. Verified like any read (the header
        always, the payload if the tier verifies payloads) and counted as a hit."""
        pool = self.host_pool
        if pool is None:
            yield None
            return
        started = time.perf_counter()
        with pool.pinned_runs(key.id) as runs:
            payload = self._raw_payload(self.first, pool, key, runs) if runs is not None else None
            if payload is not None:
                size = HEADER_BYTES + sum(n for _, n in payload)
                self._on_hit(key.id, self.first, size, time.perf_counter() - started, 0, None, None)
            yield payload

    def _raw_payload(self, tier: Tier, pool: SharedPool, key: ChunkKey, runs: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
        """The payload ranges of a pinned blob if it holds raw bytes; a corrupt one is dropped."""
        size = sum(n for _, n in runs)
        header_runs, payload = _split_runs(runs, HEADER_BYTES)
        try:
            header = self._checked_header(tier, key, b"".join(pool.views(header_runs)), size)
            if header.codec_id != 0:
                return None
            if self._verify[tier.name]:
                digest = xxhash.xxh3_64()
                for view in pool.views(payload):
                    digest.update(view)
                if digest.intdigest() != header.payload_checksum:
                    raise PayloadChecksumMismatch(f"{tier.name}: payload checksum mismatch")
        except CorruptBlob as exc:
            self._on_corrupt(key.id, tier, exc)
            return None
        return payload

    def _vanished(self, key_id: bytes, tier: Tier):
        """The tier no longer has the value read (evicted by Redis, deleted by another daemon),
        or placement re-encoded it meanwhile: then ``_REENCODED``, and the index is right."""
        with self._lock:
            entry = self._index.get(key_id)
            if entry is not None and tier.name in entry.replicas and tier.size_of(key_id) == entry.size_in(tier.name):
                return _REENCODED
            if entry is not None and tier.name in entry.replicas:
                entry.replicas.discard(tier.name)
                self._usage.removed(tier.name, key_id)
                self._sync_policies(key_id, entry)
                if not entry.replicas and not entry.pending:
                    del self._index[key_id]
        if tier.shared and self.shared_index is not None:
            self._index_updates.put((tier.name, key_id))
        return None

    def _on_hit(
        self, key_id: bytes, tier: Tier, size: int, elapsed: float, codec_id: int, header_buf, payload_buf
    ) -> None:
        with self._lock:
            self._hits += 1
            stats = self._stats[tier.name]
            stats.lossy_hits += not codec_by_id(codec_id).lossless
            stats.hits += 1
            stats.bytes_read += size
            gbps = size / max(elapsed, 1e-9) / 1e9
            stats.read_gbps = gbps if stats.read_gbps == 0 else (1 - EWMA_ALPHA) * stats.read_gbps + EWMA_ALPHA * gbps
            entry = self._index.get(key_id)
            if entry is None:
                return
            for name, policy in self._policies.items():
                if name in entry.replicas:  # held chunks too: the policy keeps the hit for their hand-back
                    policy.on_hit(key_id)
            promote = self.config.promote_on_read and tier is not self.first
            promote = promote and self.first.name not in entry.replicas and entry.size_in(tier.name) == size
            encoding = None if size == entry.size else (size, codec_id)
        if promote:
            try:
                self._write_first(key_id, [header_buf, payload_buf], size, None, wait=False, encoding=encoding)
            except TierFull:
                pass  # the first tier is full of pinned or queued chunks: serve without promoting

    def _on_corrupt(self, key_id: bytes, tier: Tier, exc: Exception) -> None:
        log.warning("%s: dropping corrupt blob %s: %s", tier.name, key_id.hex(), exc)
        with self._lock:
            self._stats[tier.name].corruptions += 1
            entry = self._index.get(key_id)
            if entry is not None:
                self._drop_replica(key_id, entry, tier)
            else:
                self._delete_from(tier, key_id)

    def replicas(self, keys: Sequence[ChunkKey]) -> list[frozenset[str]]:
        """The tiers holding each of the leading present keys (index only)."""
        self.lookup(keys)
        with self._lock:
            out = []
            for key in keys:
                entry = self._index.get(key.id)
                if entry is None or not entry.replicas:
                    break
                out.append(frozenset(entry.replicas))
            return out

    def stream(
        self,
        keys: Sequence[ChunkKey],
        outs: Sequence[torch.Tensor] | None = None,
        tiers: Sequence[str] | None = None,
    ) -> Iterator[torch.Tensor]:
        """Free-tier fetch of the leading present chunks, yielded in order as they arrive.

        Each tier's workers take the earliest chunk their tier holds, so all tiers holding
        replicas read at once. ``outs`` are filled when given (a chunk taken over from a
        stalled tier arrives in a fresh tensor instead); ``tiers`` restricts the tiers used.
        Stops before the first chunk no replica can deliver.
        """
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
            outs = [torch.empty(k.namespace.chunk_shape, dtype=_torch_dtype(k.namespace.dtype)) for k in keys[:n]]
        else:
            for k, o in zip(keys, outs):
                self._check_chunk(k, o)
        job = FetchJob(replicas, outs[:n], lambda tier, i, out: self._fetch_one(tier, keys[i], out), self.config.fetch_stall_s)
        for tier in job.tiers():
            for _ in range(self.fetch_workers[tier]):
                self._fetch_pools[tier].submit(job.work, tier)
        try:
            yield from job.results()
        finally:
            job.cancel()

    def _fetch_one(self, tier_name: str, key: ChunkKey, out: torch.Tensor) -> bool:
        tier = self._by_name[tier_name]
        try:
            return self._read_tier(tier, key, out) is not None
        except CorruptBlob as exc:
            self._on_corrupt(key.id, tier, exc)
        except TierError as exc:
            with self._lock:
                self._stats[tier.name].errors += 1
            log.warning("%s: read of %s failed: %s", tier.name, key, exc)
        return False

    def get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading chunks of ``keys`` that can be loaded, in order (stops at the first miss)."""
        return list(self.stream(keys))

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        """Load the leading loadable chunks into ``outs`` (reused buffers); returns how many."""
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} buffers for {len(keys)} keys")
        n = 0
        for i, chunk in enumerate(self.stream(keys, outs=outs)):
            if chunk is not outs[i]:
                outs[i].copy_(chunk)  # taken over from a stalled tier into a fresh tensor
            n += 1
        return n

    def drop(self, keys: Sequence[ChunkKey], tier_name: str) -> int:
        """Remove one tier's copies of ``keys`` (other replicas stay); returns how many were there."""
        tier = self._by_name[tier_name]
        dropped = 0
        with self._lock:
            for key in keys:
                entry = self._index.get(key.id)
                if entry is not None and tier_name in entry.replicas:
                    self._drop_replica(key.id, entry, tier)
                    dropped += 1
        return dropped

    # -- delete, stats, close -----------------------------------------------------------------

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks from every tier; returns how many were present."""
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._index.pop(key.id, None)
                if entry is None:
                    continue
                removed += 1
                for name in list(entry.replicas):
                    self._delete_from(self._by_name[name], key.id)
                entry.replicas.clear()
                entry.pinned_until = 0.0
                self._sync_policies(key.id, entry)
        return removed

    def stats(self) -> StoreStats:
        with self._lock:
            now = time.monotonic()
            return StoreStats(
                tiers={
                    t.name: TierStats(**{**self._stats[t.name].__dict__, "used_bytes": t.used_bytes, "chunks": len(t)})
                    for t in self.tiers
                },
                chunks=len(self._index),
                puts=self._puts,
                hits=self._hits,
                misses=self._misses,
                pinned=sum(1 for e in self._index.values() if e.pinned_until > now),
                write_behind_pending_bytes=self._pending_bytes,
                write_behind_queue=sum(q.qsize() for q in self._queues.values()),
                write_behind_dropped=self._dropped,
                recode_failures=self._recode_failures,
            )

    def close(self) -> None:
        """Flush queued copies, stop the workers and release the tiers."""
        if self._closed:
            return
        self.flush()
        with self._lock:
            self._closed = True
            self._changed.notify_all()
        for tier in self.replica_tiers:
            for _ in range(max(1, self.config.write_behind.workers)):
                self._queues[tier.name].put(None)
        if self.shared_index is not None:
            self._index_updates.put(None)
        for t in self._workers:
            t.join()
        self._readers.shutdown(wait=True)
        for pool in self._fetch_pools.values():
            pool.shutdown(wait=True)
        for tier in reversed(self.tiers):
            tier.close()
        if self.shared_index is not None:
            self.shared_index.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
