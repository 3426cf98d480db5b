"""How many cold reads a device serves best at once, measured, and the page-cache tools that
measuring cold reads needs.

A local disk's best queue depth depends on the device (one virtual disk here peaks at 1-2
reads in flight and loses a third at 8; an NVMe drive wants more), so the disk tier's fetch
workers are sized by reading probe files cold at 1, 2, 4 and 8 in flight. The probe runs
once per device and process, and its answer is kept in the data directory for later starts.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import logging
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

log = logging.getLogger(__name__)

INFLIGHT = (1, 2, 4, 8)
PROBE_FILES = 16
PROBE_FILE_BYTES = 4 << 20
RESULT_NAME = ".read-parallelism"
# 2: read buffers set up outside the timing (version 1 counted their first-touch page faults
# as disk time, which favoured few reads in flight): a saved answer of another version is measured again
PROBE_VERSION = 2
FALLBACK = 4  # where cold reads cannot be measured (a tmpfs, a read-only directory)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value

_measured: dict[tuple[int, bool], int] = {}  # (st_dev, O_DIRECT) -> best reads in flight
_lock = threading.Lock()


def cached_bytes(path: str) -> int:
    """Bytes of ``path`` resident in the page cache now (``mincore`` over a mapping of it)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = sum(b & 1 for b in vec)
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return min(size, resident * mmap.PAGESIZE)


class StillCached(RuntimeError):
    """Files stayed in the page cache after being dropped (a tmpfs): no cold read there."""


def drop_cache(paths: Sequence[str]) -> None:
    """Write back and drop the files' cached pages (fdatasync + POSIX_FADV_DONTNEED), then check
    with ``mincore`` that they are gone."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    still = [p for p in paths if cached_bytes(p)]
    if still:
        raise StillCached(f"{len(still)} of {len(paths)} files stay in the page cache after fadvise "
                          f"(e.g. {still[0]}: a tmpfs?): a cold read cannot be measured there")


def read_buffers(paths: Sequence[str], count: int) -> list[mmap.mmap]:
    """``count`` page-aligned, pre-touched buffers, each big enough for any of ``paths``. Make
    them before a timing starts: the first touch of fresh pages is not the disk's time (one
    32 MiB buffer takes 50 ms to touch on a VM, eight take 340 ms)."""
    need = -(-max(os.path.getsize(p) for p in paths) // mmap.PAGESIZE) * mmap.PAGESIZE
    buffers = [mmap.mmap(-1, need) for _ in range(count)]
    for b in buffers:
        b.write(b"\0" * need)
    return buffers


def read_all(paths: Sequence[str], inflight: int, direct: bool, read_bytes: int | None = None,
             buffers: Sequence[mmap.mmap] | None = None) -> None:
    """Read each file into page-aligned, pre-touched buffers (``buffers``, from
    ``read_buffers``; made here if None), ``inflight`` files at once: in one read call per
    file, or in calls of ``read_bytes`` (as the disk tier reads when it hashes what lands,
    which keeps the kernel's readahead ahead of the copies)."""
    if buffers is None:
        buffers = read_buffers(paths, inflight)
    if len(buffers) < inflight:
        raise ValueError(f"{len(buffers)} buffers for {inflight} reads in flight")
    free = list(range(inflight))
    lock = threading.Lock()
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)

    def read(path: str) -> None:
        with lock:
            slot = free.pop()
        try:
            view = memoryview(buffers[slot])
            step = read_bytes or len(view)
            fd = os.open(path, flags)
            try:
                offset = 0
                while True:
                    got = os.preadv(fd, [view[offset % len(view) : offset % len(view) + step]], offset)
                    if got == 0:
                        break
                    offset += got
            finally:
                os.close(fd)
        finally:
            with lock:
                free.append(slot)

    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(read, paths))


def best_inflight(paths: Sequence[str], direct: bool, inflight: Sequence[int] = INFLIGHT,
                  read_bytes: int | None = None) -> tuple[int, dict[int, float]]:
    """The reads in flight that read ``paths`` cold the fastest, and seconds per setting."""
    seconds = {}
    buffers = read_buffers(paths, max(inflight))  # outside the timing
    for n in inflight:
        drop_cache(paths)
        t = time.perf_counter()
        read_all(paths, n, direct, read_bytes, buffers)
        seconds[n] = time.perf_counter() - t
    return min(seconds, key=seconds.get), seconds


def read_parallelism(root: str, direct: bool = False, temp_suffix: str = ".tmp", read_bytes: int | None = None) -> int:
    """Best cold reads in flight for the device holding ``root``, each file read in calls of
    ``read_bytes`` (whole if None), as the tier reads: measured once per device and process,
    and kept in ``root`` for later starts. ``FALLBACK`` where it cannot be measured."""
    key = (os.stat(root).st_dev, direct)
    saved = os.path.join(root, RESULT_NAME)
    with _lock:
        if key in _measured:
            return _measured[key]
        try:
            with open(saved) as f:
                data = json.load(f)
            if data.get("version") == PROBE_VERSION:
                _measured[key] = int(data["inflight"][str(direct).lower()])
                return _measured[key]
        except (OSError, ValueError, KeyError, TypeError):
            pass
        _measured[key] = n = _probe(root, direct, temp_suffix, read_bytes)
        try:
            data = {}
            try:
                with open(saved) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                pass
            if not isinstance(data, dict) or data.get("version") != PROBE_VERSION:
                data = {"version": PROBE_VERSION}
            data.setdefault("inflight", {})[str(direct).lower()] = n
            with open(saved, "w") as f:
                json.dump(data, f)
        except OSError:
            pass
        return n


def _probe(root: str, direct: bool, temp_suffix: str, read_bytes: int | None) -> int:
    # temporary names: a crash mid-probe leaves files the tier removes at its next start
    paths = [os.path.join(root, f"read-probe-{os.getpid()}-{i}{temp_suffix}") for i in range(PROBE_FILES)]
    try:
        block = os.urandom(PROBE_FILE_BYTES)
        for p in paths:
            with open(p, "wb") as f:
                f.write(block)
        n, seconds = best_inflight(paths, direct, read_bytes=read_bytes)
        log.info("%s: %d cold reads in flight read fastest (%s)", root, n,
                 ", ".join(f"{k}: {PROBE_FILES * PROBE_FILE_BYTES / s / 1e9:.2f} GB/s" for k, s in seconds.items()))
        return n
    except (OSError, StillCached) as exc:
        log.info("%s: cold reads cannot be measured (%s); %d reads in flight", root, exc, FALLBACK)
        return FALLBACK
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass
