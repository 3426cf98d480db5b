"""The read path: read one replica, verify it, decode it into the caller's buffer, count the
hit, and hand the bytes to promotion (a callback: the read path writes nothing itself).

Who owns the caller's buffer: a read call until it returns. ``stream`` and ``get_many_into``
close their fetch before returning, and closing waits for every read still writing into a
caller's buffer (kvstore/store/fetch.py); reads from tiers that may hang (shared ones) go into
buffers of their own. So a checksum is only ever computed over bytes the store wrote, and a
failure is the replica's (review #5).

A replica is read straight into the caller's tensor only when the index knows it holds raw
bytes (its codec, not its size, decides: an encoded payload may be exactly raw-sized,
review #6); anything else is read into a scratch buffer and decoded. A decode failure is a
corrupt replica: counted and dropped, never returned.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from kvstore.blob import (HEADER_BYTES, BlobHeader, CorruptBlob, PayloadChecksumMismatch, decode_header, payload_digest,
                          payload_matches)
from kvstore.codecs import codec_by_id
from kvstore.codecs.raw import tensor_bytes
from kvstore.store.fetch import FetchJob
from kvstore.store.index import ChunkIndex, Replica
from kvstore.keys import ChunkKey
from kvstore.store.deletes import TierIO
from tiers.base import FirstTier, Tier, TierError

log = logging.getLogger(__name__)

_RETRY = object()  # the replica changed under the read (re-encoded, replaced): read it again


class ReplacedBlob(Exception):
    """A shared tier's value is a whole, valid blob of the chunk, but not the one the index
    lists there: another daemon put the chunk in its own encoding (the codec is not part of
    the key) or in the same one with other bytes, or it is an older put of ours found at start."""

@dataclass
class LentChunk:
    """A chunk's raw tensor bytes where they lie in the first tier's pool: (pool offset,
    length) ranges in order, pinned there until ``release()`` (the second phase of a
    two-phase read; calling it again does nothing)."""

    runs: list[tuple[int, int]]
    release: Callable[[], None]


@dataclass
class _Pin:
    """A raw chunk pinned in the first tier's pool, its header checked: the blob's size, the
    header, the payload's ranges, and the call that unpins it."""

    size: int
    header: BlobHeader
    payload: list[tuple[int, int]]
    release: Callable[[], None]


# promote(key id, version, blob parts, size, blob header): a hit below the first tier
Promote = Callable[[bytes, int, list, int, BlobHeader], None]


def split_runs(runs: list[tuple[int, int]], n: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
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


def _once(call: Callable[[], None]) -> Callable[[], None]:
    """``call``, made at most once however often the result is called."""
    pending = [call]

    def once() -> None:
        try:
            taken = pending.pop()  # atomic: of two threads calling at once, one takes it
        except IndexError:
            return
        taken()

    return once


def checked_header(tier: Tier, key: ChunkKey, header_buf, size: int) -> BlobHeader:
    """The header of a ``size``-byte blob read for ``key``; CorruptBlob if it does not fit."""
    header = decode_header(header_buf)
    if header.key_id != key.id:
        raise CorruptBlob(f"{tier.name}: blob names another key")
    if header.dtype != key.namespace.torch_dtype or header.shape != key.namespace.chunk_shape:
        raise CorruptBlob(f"{tier.name}: blob holds {header.dtype}{list(header.shape)}")
    if header.payload_len != size - HEADER_BYTES:
        raise CorruptBlob(f"{tier.name}: payload length {header.payload_len} != {size - HEADER_BYTES}")
    return header


class ReadPath:
    def __init__(self, index: ChunkIndex, io: TierIO, tiers: Sequence[Tier], verify: dict[str, bool],
                 fetch_pools: dict, fetch_workers: dict[str, int], stall_s: float, promote: Promote,
                 blob_version: int) -> None:
        self.index, self.io, self.tiers = index, io, list(tiers)
        self._blob_version = blob_version  # what this store writes
        self._by_name = {t.name: t for t in tiers}
        self._verify = verify
        self._pools = fetch_pools
        self._workers = fetch_workers
        self._stall_s = stall_s
        self._promote = promote
        self._busy: dict[str, int] = {}  # reads of one chunk in flight, per tier
        self._busy_lock = threading.Lock()

    # -- one chunk ------------------------------------------------------------------------

    def holding(self, key_id: bytes) -> list[Tier]:
        """Tiers with a readable replica, fastest first."""
        with self.index.lock:
            entry = self.index.get(key_id)
            return [] if entry is None else [t for t in self.tiers if entry.current(t.name) is not None]

    def read(self, key: ChunkKey, out: torch.Tensor | Callable[[], torch.Tensor] | None):
        """True (``out`` filled) or the blob's bytes (``out`` None) from the fastest replica
        that reads and verifies; None on a miss. ``out`` may be a function giving the tensor,
        called only once some tier holds the chunk. Below the first tier, a tier with a read
        in flight for each of its fetch workers comes after those with one free: reads of one
        chunk each, many at once (a daemon's Gets), spread over every replica as a stream's
        do (free-tier fetching), instead of queueing on the fastest tier."""
        holders = self.holding(key.id)
        if holders and callable(out):
            out = out()
        for tier in self._least_busy_first(holders):
            with self._busy_lock:
                self._busy[tier.name] = self._busy.get(tier.name, 0) + 1
            try:
                result = self.read_tier(tier, key, out)
            finally:
                with self._busy_lock:
                    self._busy[tier.name] -= 1
            if result is not None:
                return result
        with self.index.lock:
            self.index.read_miss(key.id)
        return None

    def _least_busy_first(self, tiers: list[Tier]) -> list[Tier]:
        """``tiers`` (fastest first) ordered by how many reads each has queued beyond its
        fetch workers, fastest first among equals; the first tier, when it holds the chunk,
        stays first (RAM is never worth skipping)."""
        if len(tiers) < 2 or tiers[0] is self.tiers[0]:
            return tiers
        with self._busy_lock:
            return sorted(tiers, key=lambda t: self._busy.get(t.name, 0) // self._workers.get(t.name, 1))

    def read_tier(self, tier: Tier, key: ChunkKey, out: torch.Tensor | None,
                  accept: Callable[[], bool] | None = None):
        """Read and verify one replica; None if it is not there, is corrupt (dropped) or the
        tier failed (counted). A replica changed while being read is read again once.
        ``accept()``, asked once the bytes are verified, False: another read served the chunk
        (a takeover), so this one is no hit (not counted, not shown to the policy, not
        promoted) and returns None."""
        for _ in range(2):
            try:
                result = self._read_once(tier, key, out, accept)
            except TierError as exc:
                with self.index.lock:
                    self.index.count(tier.name, errors=1)
                log.warning("%s: read of %s failed: %s", tier.name, key, exc)
                return None
            if result is not _RETRY:
                return result
        return None

    def _read_once(self, tier: Tier, key: ChunkKey, out: torch.Tensor | None,
                   accept: Callable[[], bool] | None = None):
        key_id = key.id
        with self.index.lock:
            entry = self.index.get(key_id)
            replica = entry.current(tier.name) if entry is not None else None
            if replica is None:
                return None
            size, codec_id, version, expected = replica.size, replica.codec_id, replica.version, entry.header
            checksum = replica.checksum
        header_buf = bytearray(HEADER_BYTES)
        direct = out is not None and codec_id == 0 and size == HEADER_BYTES + out.numel() * out.element_size()
        payload_buf = tensor_bytes(out) if direct else memoryview(bytearray(max(size - HEADER_BYTES, 0)))
        verify = self._verify[tier.name]
        # of the version the blob most likely has (a blob of another one is hashed again)
        digest = payload_digest(expected.version if expected is not None else self._blob_version) if verify else None
        started = time.perf_counter()
        try:
            if verify:  # the checksum is computed on the bytes as they land, not in a second pass
                got = tier.read_into_hashing(key_id, [memoryview(header_buf), payload_buf], HEADER_BYTES, digest)
            else:
                got = tier.read_into(key_id, [memoryview(header_buf), payload_buf])
        except ValueError:  # a larger value took its place meanwhile
            if tier.shared:
                return self._replaced(key_id, tier, replica)  # a peer's: not ours to unlist or delete
            got = None
        elapsed = time.perf_counter() - started
        if got is None:
            return self._vanished(key_id, tier, replica)
        if got != size and tier.size_of(key_id) != size:
            if tier.shared and self._whole(tier, key, header_buf, payload_buf, got, digest):
                return self._replaced(key_id, tier, replica)
            return self._vanished(key_id, tier, replica)
        shared = tier.shared
        try:
            header = self._verified(tier, key, header_buf, payload_buf, got, size, codec_id, digest,
                                    None if direct else out, expected if shared else None, checksum if shared else None)
        except ReplacedBlob:
            return self._replaced(key_id, tier, replica)
        except CorruptBlob as exc:
            return None if self.io.corrupt(key_id, tier, replica, exc) else _RETRY
        if accept is not None and not accept():
            return None  # another tier's read served the chunk: one chunk, one hit
        self._hit(key_id, tier, replica, header, elapsed, version, [header_buf, payload_buf])
        return True if out is not None else bytes(header_buf) + bytes(payload_buf)

    @staticmethod
    def _whole(tier: Tier, key: ChunkKey, header_buf, payload_buf, got: int, digest) -> bool:
        """Whether the ``got`` bytes read are a whole, valid blob of ``key`` (hashed as read;
        unhashed, where the tier does not verify payloads, its verified header says so: it is a
        put of the chunk, which is not ours to unlist)."""
        try:
            header = checked_header(tier, key, header_buf, got)
        except CorruptBlob:
            return False
        return digest is None or payload_matches(header, digest, memoryview(payload_buf)[: got - HEADER_BYTES])

    @staticmethod
    def _verified(tier: Tier, key: ChunkKey, header_buf, payload_buf, got: int, size: int, codec_id: int | None,
                  digest, decode_into: torch.Tensor | None, expected: BlobHeader | None = None,
                  checksum: int | None = None) -> BlobHeader:
        """The header of a blob just read, once its length, header, checksum (where ``digest``
        hashed it), codec and decoding (into ``decode_into``) check out; else CorruptBlob.
        ``expected`` and ``checksum``: on a shared tier, the blob the index's entry names and
        the payload checksum of the one this store wrote or verified there (None: not known
        yet); a valid blob of another codec or another checksum, or one that differs from
        ``expected`` where the replica's codec is not known yet, raises ReplacedBlob (a peer's
        put, or an older one of ours), not CorruptBlob: one codec and size may hold other
        bytes (another ranking, KV computed elsewhere). The header alone decides that (its own
        checksum is always verified), also where the payload is not hashed: another put's file
        is never deleted as corrupt, nor read as ours."""
        if got != size:
            raise CorruptBlob(f"{tier.name}: read {got} bytes, expected {size}")
        header = checked_header(tier, key, header_buf, size)
        if digest is not None and not payload_matches(header, digest, payload_buf):
            raise PayloadChecksumMismatch(f"{tier.name}: payload checksum mismatch")
        if codec_id is not None and header.codec_id != codec_id:
            if tier.shared:
                raise ReplacedBlob(f"{tier.name}: a valid blob of codec {header.codec_id}, the index says {codec_id}")
            raise CorruptBlob(f"{tier.name}: blob is encoded with codec {header.codec_id}, the index says {codec_id}")
        if checksum is not None and header.payload_checksum != checksum:
            raise ReplacedBlob(f"{tier.name}: a valid blob of the chunk, not the one this store wrote or read there")
        if codec_id is None and expected is not None and header != expected:
            raise ReplacedBlob(f"{tier.name}: a valid blob of the chunk, not the one its latest put wrote")
        if decode_into is not None:
            try:  # this thread may write the caller's inference tensor in place only in inference mode
                with torch.inference_mode(decode_into.is_inference()):
                    codec_by_id(header.codec_id).decode_into(payload_buf, decode_into)
            except Exception as exc:  # a payload that does not decode is corrupt, whatever the codec raised
                raise CorruptBlob(f"{tier.name}: payload does not decode ({type(exc).__name__}: {exc})") from exc
        return header

    def _vanished(self, key_id: bytes, tier: Tier, replica: Replica):
        """The tier no longer has the value (evicted by Redis, deleted by another daemon); or
        the index moved on meanwhile (re-encoded, replaced): then read again."""
        with self.index.lock:
            entry = self.index.get(key_id)
            if entry is None or entry.replicas.get(tier.name) is not replica or tier.name in entry.recoding:
                return _RETRY if entry is not None and entry.current(tier.name) is not None else None
            self.index.remove_replica(key_id, entry, tier.name)
        self.io.vanished(tier, key_id)
        return None

    def _replaced(self, key_id: bytes, tier: Tier, replica: Replica):
        """A shared tier holds another valid blob of the chunk than ``replica`` says: this
        index forgets its copy there, but neither deletes the file nor takes it out of the
        shared index (it is another daemon's put, which its daemon lists and may have made
        durable); or the index moved on meanwhile: then read again."""
        with self.index.lock:
            entry = self.index.get(key_id)
            if entry is None or entry.replicas.get(tier.name) is not replica:
                return _RETRY if entry is not None and entry.current(tier.name) is not None else None
            log.info("%s: %s holds another daemon's blob of the chunk now; this index forgets its copy",
                     tier.name, key_id.hex())
            self.index.remove_replica(key_id, entry, tier.name)
        return None

    def _hit(self, key_id: bytes, tier: Tier, replica: Replica, header: BlobHeader, elapsed: float,
             version: int, parts: list) -> None:
        with self.index.lock:
            promote = self.index.read_hit(key_id, tier.name, replica, header, elapsed)
        if promote:
            self._promote(key_id, version, parts, replica.size, header)

    # -- many chunks ------------------------------------------------------------------------

    def replicas(self, keys: Sequence[ChunkKey]) -> list[frozenset[str]]:
        """The tiers holding a readable replica of each leading present key (index only)."""
        out = []
        with self.index.lock:
            for key in keys:
                entry = self.index.get(key.id)
                where = frozenset(n for n in entry.replicas if entry.current(n)) if entry is not None else frozenset()
                if not where:
                    break
                out.append(where)
        return out

    def stream(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor], replicas: list[frozenset[str]]) -> Iterator[torch.Tensor]:
        """Free-tier fetch of ``len(replicas)`` leading chunks, yielded in order as they arrive:
        ``outs[i]``, or a tensor of its own for a chunk read from a tier that may hang or taken
        over from a stalled reader. Returns only when no read writes into ``outs`` any more.

        Leading chunks the first tier holds are read right here, in order: a copy out of host
        RAM is faster than any other replica and needs no worker (handing each to a pool
        costs more than the copy). The rest are fetched from every tier at once."""
        first = self._by_name[self.index.first]
        done = 0
        while done < len(replicas) and first.name in replicas[done]:
            if self.read_tier(first, keys[done], outs[done]) is None:
                break  # gone from the first tier meanwhile: the fetch below tries every replica
            yield outs[done]
            done += 1
        if done == len(replicas):
            return
        keys, outs, replicas = keys[done:], outs[done:], replicas[done:]
        detached = {t.name for t in self.tiers if t.shared}
        job = FetchJob(replicas, outs[: len(replicas)],
                       lambda tier, i, out: self.read_tier(self._by_name[tier], keys[i], out,
                                                           lambda: job.accept(i, tier)) is not None,
                       self._stall_s, detached=detached)
        try:  # a hand-off that raises (a pool shut down meanwhile) still waits for the workers handed off
            for tier in job.tiers():
                for _ in range(self._workers[tier]):
                    self._pools[tier].submit(job.work, tier)
            yield from job.results()
        finally:
            job.close()

    # -- lending: the first tier's raw bytes, pinned --------------------------------------------------

    def lend(self, first: FirstTier, key: ChunkKey, contiguous: bool = False) -> LentChunk | None:
        """``Store.lend``; with ``contiguous``, only a chunk that lies in one piece."""
        lent = self.lend_many(first, [key], contiguous)
        return lent[0] if lent else None

    def lend_many(self, first: FirstTier, keys: Sequence[ChunkKey], contiguous: bool = False) -> list[LentChunk]:
        """``lend`` of each leading key, up to the first that cannot be lent: the index lock
        is taken twice for all of them, not twice for each."""
        pool = first.shared_pool()
        started = time.perf_counter()
        with self.index.lock:  # the copies listed now: only they are dropped if their pinned bytes fail a check
            listed = []
            for key in keys:
                entry = self.index.get(key.id)
                replica = entry.replicas.get(first.name) if entry is not None else None
                if replica is None:
                    break
                listed.append(replica)
        pinned: list[_Pin] = []
        try:
            for key, replica in zip(keys, listed):
                pin = self._pin_raw(first, pool, key, replica, contiguous)
                if pin is None:
                    break
                pinned.append(pin)
            lent = []
            elapsed = (time.perf_counter() - started) / max(1, len(pinned))
            with self.index.lock:
                for key, pin in zip(keys, pinned):
                    entry = self.index.get(key.id)
                    replica = entry.current(first.name) if entry is not None else None
                    if replica is None or replica.size != pin.size:
                        break  # not the chunk the index lists (being replaced): use get_into
                    # the first tier: no promotion to make
                    self.index.read_hit(key.id, first.name, replica, pin.header, elapsed)
                    lent.append(LentChunk(pin.payload, _once(pin.release)))
        except BaseException:
            for pin in pinned:
                pin.release()
            raise
        for pin in pinned[len(lent):]:
            pin.release()
        return lent

    def copy_lent(self, first: FirstTier, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        """Copy the leading chunks that lie raw in the first tier into ``outs`` (contiguous CPU
        tensors of their shapes), every one pinned, checked and counted before the copies and
        released after them; how many. Why: a copy of many MiB empties the caches, and the
        bookkeeping of a read made between two copies ran cold (~250 us around a 32 MiB
        chunk's read, against ~80 for the same work done in a row). 0 where the first tier
        verifies payloads: a lend hashes in a pass of its own, a read as it copies."""
        if self._verify[first.name]:
            return 0
        lent = self.lend_many(first, keys)
        if not lent:
            return 0
        try:
            runs, dsts = [chunk.runs for chunk in lent], [tensor_bytes(out) for out in outs[: len(lent)]]
            first.shared_pool().read_runs_into(runs, dsts)
        finally:
            for chunk in lent:
                chunk.release()
        return len(lent)

    def _pin_raw(self, first: FirstTier, pool, key: ChunkKey, listed: Replica, contiguous: bool) -> _Pin | None:
        """The chunk pinned where it lies raw in ``pool``, header checked (and payload, if the
        tier verifies payloads); None, pinning nothing, where it is absent, encoded, corrupt
        (dropped) or, with ``contiguous``, split over pages."""
        pinned = pool.pin_runs(key.id)
        if pinned is None:
            return None
        runs, release = pinned
        try:
            size = sum(n for _, n in runs)
            header_runs, payload = split_runs(runs, HEADER_BYTES)
            try:
                header = checked_header(first, key, b"".join(pool.views(header_runs)), size)
                if header.codec_id == 0 and self._verify[first.name]:
                    digest = payload_digest(header.version)
                    for view in pool.views(payload):
                        digest.update(view)
                    if digest.intdigest() != header.payload_checksum:
                        raise PayloadChecksumMismatch(f"{first.name}: payload checksum mismatch")
            except CorruptBlob as exc:
                self.io.corrupt(key.id, first, listed, exc)
                header = None
        except BaseException:
            release()
            raise
        if header is None or header.codec_id != 0 or (contiguous and len(payload) != 1):
            release()
            return None
        return _Pin(size, header, payload, release)
