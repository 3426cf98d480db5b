"""The Store: the facade the daemon, the connector and the benchmarks use.

A put lands in host RAM synchronously and is copied behind to the local disk through a
bounded queue; while a copy is queued its host pages cannot be evicted, and a put waits
when the queue holds ``max_pending_bytes`` (backpressure: memory stays bounded). A read
that misses host RAM but hits the disk is verified, delivered and promoted to host RAM.
Lookups answer from the in-memory index and never do I/O. Every blob read is verified; a
corrupt one is deleted, counted and treated as a miss.

Thread-safe: one lock guards the index and the policies; copies and disk I/O run outside it.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvstore.blob import (
    DTYPE_NAMES,
    HEADER_BYTES,
    CorruptBlob,
    PayloadChecksumMismatch,
    decode_header,
    encode_header,
    payload_checksum,
)
from kvstore.codecs import codec_by_id, get_codec
from kvstore.codecs.raw import tensor_bytes
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey
from kvstore.policies import make_policy
from tiers.base import Tier, TierError, TierFull
from tiers.host import HostTier
from tiers.nvme import DiskTier

log = logging.getLogger(__name__)


class StoreClosed(RuntimeError):
    pass


@dataclass
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corruptions: int = 0
    errors: int = 0


@dataclass
class StoreStats:
    tiers: dict[str, TierStats]
    chunks: int = 0
    puts: int = 0
    hits: int = 0
    misses: int = 0
    write_behind_pending_bytes: int = 0
    write_behind_queue: int = 0
    write_behind_dropped: int = 0


@dataclass
class _Entry:
    size: int  # blob bytes
    in_host: bool = False
    on_disk: bool = False
    pending: int = 0  # copies to disk queued; host pages are not evictable meanwhile
    waiters: list[threading.Event] = field(default_factory=list)
    disk_error: Exception | None = None


class Store:
    def __init__(self, config: StoreConfig | None = None) -> None:
        self.config = config = config or StoreConfig()
        wb = config.write_behind
        self.max_pending_bytes = wb.max_pending_bytes or config.host.capacity_bytes // 4
        if config.disk.enabled and self.max_pending_bytes > config.host.capacity_bytes // 2:
            raise ValueError("write_behind.max_pending_bytes must be at most half of host.capacity_bytes")
        self.codec = get_codec(config.codec)
        self.host = HostTier(
            config.host.capacity_bytes, config.host.page_bytes, config.host.prefault, config.host.shm_path
        )
        self.disk: DiskTier | None = None
        if config.disk.enabled:
            d = config.disk
            self.disk = DiskTier(d.path, d.capacity_bytes, d.fsync, d.o_direct, d.read_threads)
        self._lock = threading.RLock()
        self._drained = threading.Condition(self._lock)
        self._index: dict[bytes, _Entry] = {}
        self._policies = {self.host.name: make_policy(config.eviction_policy, self.host.capacity_bytes)}
        self._stats = {self.host.name: TierStats(self.host.name, self.host.capacity_bytes)}
        self._verify = {self.host.name: config.host.verify_payload}
        self._puts = self._hits = self._misses = self._dropped = 0
        self._pending_bytes = 0
        self._closed = False
        self._queue: queue.Queue[tuple[bytes, _Entry, int] | None] = queue.Queue()
        self._workers: list[threading.Thread] = []
        self._readers = ThreadPoolExecutor(max(1, config.disk.read_threads), thread_name_prefix="store-get")
        if self.disk is not None:
            self._policies[self.disk.name] = make_policy(config.eviction_policy, self.disk.capacity_bytes)
            self._stats[self.disk.name] = TierStats(self.disk.name, self.disk.capacity_bytes)
            self._verify[self.disk.name] = config.disk.verify_payload
            self._recover_disk()
            for i in range(max(1, wb.workers)):
                t = threading.Thread(target=self._write_behind_loop, name=f"write-behind-{i}", daemon=True)
                t.start()
                self._workers.append(t)

    # -- recovery ---------------------------------------------------------------------------

    def _recover_disk(self) -> None:
        policy = self._policies[self.disk.name]
        for key in self.disk.keys():
            size = self.disk.size_of(key)
            if size is None:
                continue
            self._index[key] = _Entry(size=size, on_disk=True)
            policy.on_insert(key, self.disk.footprint(size))
        self._evict_to_fit(self.disk, 0)
        if self._index:
            log.info("recovered %d chunks (%d bytes) from %s", len(self._index), self.disk.used_bytes, self.disk.root)

    # -- validation -------------------------------------------------------------------------

    @staticmethod
    def _check_chunk(key: ChunkKey, kv: torch.Tensor) -> None:
        ns = key.namespace
        if not isinstance(kv, torch.Tensor):
            raise TypeError(f"chunk must be a torch.Tensor, got {type(kv).__name__}")
        if DTYPE_NAMES.get(kv.dtype) != ns.dtype:
            raise ValueError(f"chunk dtype {kv.dtype} does not match namespace dtype {ns.dtype}")
        if tuple(kv.shape) != ns.chunk_shape:
            raise ValueError(f"chunk shape {tuple(kv.shape)} does not match namespace chunk shape {ns.chunk_shape}")

    # -- put --------------------------------------------------------------------------------

    def put(
        self,
        key: ChunkKey,
        kv: torch.Tensor,
        *,
        parent: ChunkKey | None = None,
        durable: bool = False,
        codec: str | None = None,
    ) -> None:
        """Store one chunk. Returns once it is in host RAM, or on disk too if ``durable``."""
        self._check_chunk(key, kv)
        chosen = get_codec(codec) if codec else self.codec
        kv = kv.detach().to("cpu").contiguous()
        payload = chosen.encode(kv)
        header = encode_header(key, chosen.codec_id, kv.dtype, kv.shape, payload)
        self.put_blob(key.id, [header, payload], parent=parent.id if parent else None, durable=durable)

    def put_blob(self, key_id: bytes, parts: Sequence, *, parent: bytes | None = None, durable: bool = False) -> None:
        """Store an already encoded blob (header + payload, possibly in pieces)."""
        size = sum(memoryview(p).nbytes for p in parts)
        waiter = threading.Event() if durable and self.disk is not None else None
        with self._lock:
            self._check_open()
            self._puts += 1
            entry = self._index.get(key_id)
            if entry is not None and entry.in_host and entry.size == size:
                if key_id in self._policies[self.host.name]:
                    self._policies[self.host.name].on_hit(key_id)  # same prefix, same chunk
            else:
                self._reserve_write_behind(size)
                entry = self._write_host(key_id, parts, size, parent)
            if self.disk is not None and not entry.on_disk:
                if not entry.pending:
                    self._queue_disk_copy(key_id, entry)
                if waiter is not None:
                    entry.waiters.append(waiter)
            elif waiter is not None:
                waiter.set()
        if waiter is not None:
            waiter.wait()
            if entry.disk_error is not None:
                raise entry.disk_error

    def _reserve_write_behind(self, size: int) -> None:
        """Backpressure: wait (releasing the lock) until the queue has room for ``size`` bytes."""
        if self.disk is None:
            return
        limit = self.max_pending_bytes
        while self._pending_bytes > 0 and self._pending_bytes + size > limit:
            self._drained.wait()
            self._check_open()

    def _write_host(self, key_id: bytes, parts, size: int, parent: bytes | None) -> _Entry:
        """Copy a blob into host RAM, evicting as needed (caller holds the lock)."""
        policy = self._policies[self.host.name]
        self._evict_to_fit(self.host, self.host.footprint(size), exclude=key_id)
        self.host.write(key_id, parts)
        self._stats[self.host.name].bytes_written += size
        entry = self._index.get(key_id)
        if entry is None:
            entry = self._index[key_id] = _Entry(size=size)
        elif entry.on_disk and entry.size != size:
            self._drop_replica(key_id, entry, self.disk)  # re-encoded: the old disk copy is stale
        policy.on_remove(key_id)
        entry.size, entry.in_host = size, True
        if not entry.pending:
            policy.on_insert(key_id, self.host.footprint(size), parent)
        return entry

    def _queue_disk_copy(self, key_id: bytes, entry: _Entry) -> None:
        entry.pending += 1
        entry.disk_error = None
        self._policies[self.host.name].on_remove(key_id)  # pinned in host until copied
        self._pending_bytes += entry.size
        self._queue.put((key_id, entry, entry.size))

    def _evict_to_fit(self, tier: Tier, need: int, exclude: bytes | None = None) -> None:
        """Evict from ``tier`` until ``need`` more bytes fit (caller holds the lock)."""
        policy = self._policies[tier.name]
        while tier.capacity_bytes - tier.used_bytes < need:
            try:
                victim = policy.evict()
            except LookupError:
                if tier is self.host and self._pending_bytes > 0:
                    self._drained.wait()  # everything evictable is waiting for the disk
                    continue
                raise TierFull(f"{tier.name}: cannot make room for {need} bytes") from None
            if victim == exclude:
                continue
            entry = self._index.get(victim)
            self._stats[tier.name].evictions += 1
            if entry is None:
                tier.delete(victim)
                continue
            self._drop_replica(victim, entry, tier)

    def _drop_replica(self, key_id: bytes, entry: _Entry, tier: Tier) -> None:
        """Remove one tier's copy; forget the chunk when no copy is left (lock held)."""
        tier.delete(key_id)
        self._policies[tier.name].on_remove(key_id)
        if tier is self.host:
            entry.in_host = False
        else:
            entry.on_disk = False
        if not entry.in_host and not entry.on_disk and not entry.pending:
            self._index.pop(key_id, None)

    # -- write-behind -------------------------------------------------------------------------

    def _write_behind_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            self._copy_to_disk(*item)

    def _copy_to_disk(self, key_id: bytes, entry: _Entry, size: int) -> None:
        error: Exception | None = None
        written = False
        with self.host.pinned(key_id) as views:
            if views is not None and sum(len(v) for v in views) == size:
                try:
                    with self._lock:
                        self._evict_to_fit(self.disk, self.disk.footprint(size), exclude=key_id)
                    self.disk.write(key_id, views)
                    written = True
                except (TierError, OSError) as exc:
                    error = exc
        with self._lock:
            self._pending_bytes -= size
            entry.pending -= 1
            current = self._index.get(key_id)
            if written and current is entry and entry.size == size:
                self._stats[self.disk.name].bytes_written += size
                entry.on_disk = True
                disk_policy = self._policies[self.disk.name]
                disk_policy.on_remove(key_id)
                disk_policy.on_insert(key_id, self.disk.footprint(size))
            elif written and current is None:
                self.disk.delete(key_id)  # deleted while queued
            elif error is not None:
                self._stats[self.disk.name].errors += 1
                self._dropped += 1
                entry.disk_error = error
                log.warning("write-behind of %s failed: %s", key_id.hex(), error)
            if current is entry and entry.pending == 0:
                if entry.in_host:
                    self._policies[self.host.name].on_insert(key_id, self.host.footprint(entry.size))
                elif not entry.on_disk:
                    self._index.pop(key_id, None)
            if entry.pending == 0:
                for w in entry.waiters:
                    w.set()
                entry.waiters.clear()
            self._drained.notify_all()

    def flush(self) -> None:
        """Wait until every queued disk copy is written (or has failed)."""
        with self._lock:
            while self._pending_bytes > 0:
                self._drained.wait()

    # -- lookup and get -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are stored in some tier (index only, no I/O)."""
        with self._lock:
            for i, key in enumerate(keys):
                if key.id not in self._index:
                    return i
            return len(keys)

    def contains(self, key: ChunkKey) -> bool:
        return key.id in self._index

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Load a chunk into ``out`` (a contiguous CPU tensor of the chunk's shape and dtype).

        Returns False on a miss, including a corrupt replica that was just dropped.
        """
        self._check_chunk(key, out)
        if not out.is_contiguous() or out.device.type != "cpu":
            raise ValueError("out must be a contiguous CPU tensor")
        key_id = key.id
        for tier in self._tiers_holding(key_id):
            try:
                if self._read_from(tier, key, out):
                    return True
            except CorruptBlob as exc:
                self._on_corrupt(key_id, tier, exc)
            except TierError as exc:
                with self._lock:
                    self._stats[tier.name].errors += 1
                log.warning("%s: read of %s failed: %s", tier.name, key, exc)
        with self._lock:
            self._misses += 1
            for name, policy in self._policies.items():
                policy.on_miss(key_id)
                self._stats[name].misses += 1
        return False

    def _tiers_holding(self, key_id: bytes) -> list[Tier]:
        with self._lock:
            entry = self._index.get(key_id)
            if entry is None:
                return []
            tiers: list[Tier] = [self.host] if entry.in_host else []
            if entry.on_disk:
                tiers.append(self.disk)
            return tiers

    def _read_from(self, tier: Tier, key: ChunkKey, out: torch.Tensor) -> bool:
        key_id = key.id
        size = tier.size_of(key_id)
        if size is None:
            return False
        header_buf = bytearray(HEADER_BYTES)
        raw_len = out.numel() * out.element_size()
        direct = size == HEADER_BYTES + raw_len
        payload_buf = tensor_bytes(out) if direct else memoryview(bytearray(max(size - HEADER_BYTES, 0)))
        got = tier.read_into(key_id, [memoryview(header_buf), payload_buf])
        if got is None:
            return False
        if got != size:
            raise CorruptBlob(f"{tier.name}: read {got} bytes, expected {size}")
        header = decode_header(header_buf)
        if header.key_id != key_id:
            raise CorruptBlob(f"{tier.name}: blob names another key")
        if header.dtype != out.dtype or header.shape != tuple(out.shape):
            raise CorruptBlob(f"{tier.name}: blob holds {header.dtype}{list(header.shape)}")
        if header.payload_len != size - HEADER_BYTES:
            raise CorruptBlob(f"{tier.name}: payload length {header.payload_len} != {size - HEADER_BYTES}")
        if self._verify[tier.name] and payload_checksum(payload_buf) != header.payload_checksum:
            raise PayloadChecksumMismatch(f"{tier.name}: payload checksum mismatch")
        codec = codec_by_id(header.codec_id)
        if not (direct and codec.codec_id == 0):
            codec.decode_into(payload_buf, out)
        self._on_hit(key, tier, size, header_buf, payload_buf)
        return True

    def _on_hit(self, key: ChunkKey, tier: Tier, size: int, header_buf, payload_buf) -> None:
        key_id = key.id
        promote = False
        with self._lock:
            self._hits += 1
            stats = self._stats[tier.name]
            stats.hits += 1
            stats.bytes_read += size
            entry = self._index.get(key_id)
            if entry is None:
                return
            for name, policy in self._policies.items():
                if key_id in policy:
                    policy.on_hit(key_id)
            promote = tier is not self.host and not entry.in_host
            if promote:
                try:
                    self._write_host(key_id, [header_buf, payload_buf], size, None)
                except TierFull:
                    pass  # host RAM is pinned full by queued copies: serve without promoting

    def _on_corrupt(self, key_id: bytes, tier: Tier, exc: Exception) -> None:
        log.warning("%s: dropping corrupt blob %s: %s", tier.name, key_id.hex(), exc)
        with self._lock:
            self._stats[tier.name].corruptions += 1
            entry = self._index.get(key_id)
            if entry is not None:
                self._drop_replica(key_id, entry, tier)
            else:
                tier.delete(key_id)

    def get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading chunks of ``keys`` that can be loaded, in order (stops at the first miss)."""
        outs = [torch.empty(k.namespace.chunk_shape, dtype=_torch_dtype(k.namespace.dtype)) for k in keys]
        futures = [self._readers.submit(self.get_into, k, o) for k, o in zip(keys, outs)]
        result = []
        for fut, out in zip(futures, outs):
            if not fut.result():
                break
            result.append(out)
        for fut in futures[len(result):]:
            fut.cancel()
        return result

    # -- delete, stats, close ---------------------------------------------------------------------

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks from every tier; returns how many were present."""
        removed = 0
        with self._lock:
            for key in keys:
                entry = self._index.pop(key.id, None)
                if entry is None:
                    continue
                removed += 1
                for tier in (self.host, self.disk):
                    if tier is not None:
                        tier.delete(key.id)
                        self._policies[tier.name].on_remove(key.id)
        return removed

    def stats(self) -> StoreStats:
        with self._lock:
            tiers = {}
            for tier in (self.host, self.disk):
                if tier is None:
                    continue
                s = self._stats[tier.name]
                tiers[tier.name] = TierStats(**{**s.__dict__, "used_bytes": tier.used_bytes, "chunks": len(tier)})
            return StoreStats(
                tiers=tiers,
                chunks=len(self._index),
                puts=self._puts,
                hits=self._hits,
                misses=self._misses,
                write_behind_pending_bytes=self._pending_bytes,
                write_behind_queue=self._queue.qsize(),
                write_behind_dropped=self._dropped,
            )

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("store is closed")

    def close(self) -> None:
        """Flush queued disk copies, stop workers and release the tiers."""
        if self._closed:
            return
        if self.disk is not None:
            self.flush()
        with self._lock:
            self._closed = True
            self._drained.notify_all()
        for _ in self._workers:
            self._queue.put(None)
        for t in self._workers:
            t.join()
        self._readers.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
        self.host.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)
