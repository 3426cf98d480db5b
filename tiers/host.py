"""Host RAM tier: a preallocated, prefaulted pool of fixed-size pages (see tiers/pages.py).

The pool is allocated and touched once: the first write to fresh memory runs at 1.3-2 GB/s
here against ~25 GB/s for reused memory, so no chunk ever lands in fresh memory. It can live
in a file under /dev/shm so that other processes map the same bytes (the daemon's
same-host fast path). Such a file has one owner: the tier takes an open-file-description lock
on it before it truncates it, and holds it until it closes, so a second store given the same
path (in this process or another) is refused instead of zeroing the first one's chunks. That
lock is independent of the ``flock`` the daemon claims the path with (kvstore/daemon/shmfiles.py).
"""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
import struct
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import numpy as np

from kernels import host_register
from kernels.parallel_copy import copy_hashing, copy_pairs
from tiers.base import Buffer, FirstTier, TierUnavailable, as_buffers
from tiers.pages import PagedTier, segments

MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels reject it and we touch pages instead
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)


def _own(fd: int, path: str) -> None:
    """Take the write lock of ``fd``'s open file description on the whole file, or refuse
    (the lock goes with the last descriptor of it, even if the process lives on)."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        raise TierUnavailable(f"host: {path} is the host pool of another live store; give each store "
                              f"its own store.host.shm_path") from exc


def _byte_view(buf) -> np.ndarray:
    return buf.view(np.uint8).reshape(-1) if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)


class HostTier(PagedTier, FirstTier):
    hashes_its_copy = True  # write_sealed hashes each slice of the pool it has just written

    def __init__(
        self,
        capacity_bytes: int,
        page_bytes: int = 256 << 10,
        prefault: bool = True,
        shm_path: str | None = None,
        name: str = "host",
    ) -> None:
        if page_bytes % mmap.PAGESIZE:
            raise ValueError(f"page_bytes must be a positive multiple of {mmap.PAGESIZE}, got {page_bytes}")
        super().__init__(name, capacity_bytes, page_bytes)
        self.pool_bytes = self.table.pool_bytes
        self.shm_path = shm_path
        self._pool_fd = -1  # the locked descriptor of the pool file, while the tier is open
        self._mmap = self._map_pool(shm_path)
        self._pool = np.frombuffer(self._mmap, dtype=np.uint8)
        self._cuda_address: int | None = None  # the pool's, while registered with CUDA
        self._cuda_lock = threading.Lock()  # two connectors of one store may ask at once
        if prefault:
            self._prefault()

    def _map_pool(self, shm_path: str | None) -> mmap.mmap:
        if shm_path is None:
            pool = mmap.mmap(-1, self.pool_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                pool.madvise(mmap.MADV_HUGEPAGE)
            return pool
        fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            _own(fd, shm_path)  # before truncating: the bytes may be a live store's
            os.ftruncate(fd, 0)
            os.ftruncate(fd, self.pool_bytes)
            pool = mmap.mmap(fd, self.pool_bytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._pool_fd = fd
        return pool

    # -- as a SharedPool (tiers/base.py) ---------------------------------------------------

    @property
    def path(self) -> str | None:
        return self.shm_path

    def shared_pool(self) -> "HostTier":
        return self

    def register_with_cuda(self) -> bool:
        """Page-lock the pool for CUDA's copy engines (kernels/host_register.py), once; until
        the tier closes, a host -> device copy straight out of it runs as DMA at the link's
        speed, as from a pinned buffer: no staging copy. Whether the pool is registered
        (False without CUDA, or where the driver refuses). An unprefaulted pool is faulted in."""
        with self._cuda_lock:
            if self._cuda_address is None and self._pool is not None:
                self._cuda_address = host_register.register(self._pool, f"the {self.name} pool")
            return self._cuda_address is not None

    def _unregister_from_cuda(self) -> None:
        with self._cuda_lock:
            if self._cuda_address is not None:
                host_register.unregister(self._cuda_address)
                self._cuda_address = None

    def _prefault(self) -> None:
        try:
            self._mmap.madvise(MADV_POPULATE_WRITE)
        except OSError:
            self._pool[:: mmap.PAGESIZE] = 0

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        views = [_byte_view(p) for p in parts]
        value = self.table.allocate(sum(v.size for v in views))
        try:
            copy_pairs([(self._pool[start : start + n], views[i][offset : offset + n])
                        for start, i, offset, n in segments(value.runs, [v.size for v in views])])
        except BaseException:
            self.table.discard(value)
            raise
        self.table.publish(key, value)

    def write_sealed(self, key: bytes, head_bytes: int, payload: Buffer, digest, seal) -> None:
        """The payload copied in cache-sized slices, each hashed right after it lands by the
        thread that copied it (one pass over the payload's bytes, and the digest is of what
        the pool holds: ``copy_hashing``), then the head ``seal()`` packs from that digest.
        If ``seal()`` raises, nothing is stored."""
        src = _byte_view(payload)
        value = self.table.allocate(head_bytes + src.size)
        try:
            heads, body = [], []
            for start, i, offset, n in segments(value.runs, [head_bytes, src.size]):
                if i == 0:
                    heads.append((start, offset, n))
                else:
                    body.append((self._pool[start : start + n], src[offset : offset + n]))
            copy_hashing(body, digest)
            head = np.frombuffer(seal(), dtype=np.uint8)
            if head.size != head_bytes:
                raise ValueError(f"{self.name}: seal() gave {head.size} bytes, {head_bytes} expected")
            for start, offset, n in heads:
                self._pool[start : start + n] = head[offset : offset + n]
        except BaseException:  # seal() refused the payload, or the copy failed: nothing is stored
            self.table.discard(value)
            raise
        self.table.publish(key, value)

    @contextmanager
    def pinned(self, key: bytes) -> Iterator[list[memoryview] | None]:
        """Zero-copy views of a value's bytes, in order, valid inside the ``with`` block.

        Yields None if the key is absent. The pages stay allocated to this value until the
        block ends, even if the key is deleted or replaced meanwhile.
        """
        with self.pinned_runs(key) as runs:
            yield None if runs is None else self.views(runs)

    @contextmanager
    def pinned_runs(self, key: bytes) -> Iterator[list[tuple[int, int]] | None]:
        """``pinned``, as (pool offset, length) ranges: for a process that maps the same pool."""
        with self.table.reading(key) as value:
            yield None if value is None else list(value.runs)

    def pin_runs(self, key: bytes) -> tuple[list[tuple[int, int]], Callable[[], None]] | None:
        """``pinned_runs`` without a ``with`` block: the ranges, and the call (to make once)
        that unpins them; None if the key is absent."""
        value = self.table.pin(key)
        return None if value is None else (list(value.runs), functools.partial(self.table.unpin, value))

    def views(self, runs: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views of pool ranges (valid while they are pinned)."""
        return [memoryview(self._mmap)[o : o + n] for o, n in runs]

    def read_runs_into(self, runs: Sequence[Sequence[tuple[int, int]]], outs) -> None:
        """Pinned ranges copied out: each ``runs[i]`` (a value's ranges, in order) into
        ``outs[i]``, a buffer of their length; all in one copy, on torch's team where this
        thread has one, as ``read_into``'s."""
        pairs = []
        for value_runs, out in zip(runs, outs):
            dst = _byte_view(out)
            pairs += [(dst[offset : offset + n], self._pool[start : start + n])
                      for start, _, offset, n in segments(list(value_runs), [dst.size])]
        copy_pairs(pairs, team=True)

    def read(self, key: bytes) -> bytes | None:
        with self.pinned(key) as views:
            return None if views is None else b"".join(views)

    def read_into(self, key: bytes, out) -> int | None:
        outs = [_byte_view(o) for o in as_buffers(out)]
        with self.table.reading(key, capacity=sum(o.size for o in outs)) as value:
            if value is None:
                return None
            copy_pairs([(outs[i][offset : offset + n], self._pool[start : start + n])
                        for start, i, offset, n in segments(value.runs, [o.size for o in outs])], team=True)
            return value.length

    def close(self) -> None:
        self.table.clear()
        self._unregister_from_cuda()
        self._pool = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes when it does
        if self._pool_fd >= 0:
            try:
                if os.stat(self.shm_path).st_ino == os.fstat(self._pool_fd).st_ino:  # still ours
                    os.unlink(self.shm_path)
            except FileNotFoundError:
                pass
            os.close(self._pool_fd)
            self._pool_fd = -1
