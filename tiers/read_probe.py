"""How a device serves cold reads best (buffered or O_DIRECT, how many at once), measured,
and the page-cache tools that measuring cold reads needs.

A local disk's best queue depth depends on the device (an NVMe drive wants many reads in
flight, one virtual disk here peaked at 1-2 and later at 8), and so does the form: buffered
reads pay for page-cache pages (on a VM whose host takes freed memory back, each new page
can fault: this VM's buffered reads of 32 MiB chunks collapsed to a third after memory was
freed), O_DIRECT reads land in reused buffers and skip the page cache. So the disk tier's
reads are sized by reading probe files cold at 1, 2, 4 and 8 in flight, in both forms, in
turns. The probe runs once per device and process, and its figures are kept in the data
directory for later starts.
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

import xxhash

from tiers.disk import HASH_SLICE_BYTES

log = logging.getLogger(__name__)

INFLIGHT = (1, 2, 4, 8)
PROBE_FILES = 16
PROBE_FILE_BYTES = 4 << 20
RESULT_NAME = ".read-parallelism"
# 2: read buffers set up outside the timing (version 1 counted their first-touch page faults
# as disk time, which favoured few reads in flight); 3: GB/s kept per form (buffered, O_DIRECT)
# and reads in flight, each form timed with the tier's hashing (and O_DIRECT's copy out). A
# saved answer of another version is measured again.
PROBE_VERSION = 3
FALLBACK = 4  # where cold reads cannot be measured (a tmpfs, a read-only directory)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value

_measured: dict[int, dict[bool, dict[int, float]]] = {}  # st_dev -> O_DIRECT? -> reads in flight -> GB/s
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
             buffers: Sequence[mmap.mmap] | None = None, verify: bool = False,
             outs: Sequence[mmap.mmap] | None = None) -> None:
    """Read each file into page-aligned, pre-touched buffers (``buffers``, from
    ``read_buffers``; made here if None), ``inflight`` files at once: in one read call per
    file, or in calls of ``read_bytes`` (as the disk tier reads when it hashes what lands,
    which keeps the kernel's readahead ahead of the copies). With ``verify``, the disk tier's
    verification too: each slice read is hashed as it lands, and a whole file read is copied
    out into its ``outs`` buffer (as many as ``buffers``) slice by slice, each slice hashed
    after its copy (what an O_DIRECT read through a staging buffer costs)."""
    if buffers is None:
        buffers = read_buffers(paths, inflight)
    if len(buffers) < inflight or (verify and not read_bytes and (outs is None or len(outs) < inflight)):
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
            digest = xxhash.xxh3_64() if verify else None
            fd = os.open(path, flags)
            try:
                offset = 0
                while True:
                    start = offset % len(view)
                    got = os.preadv(fd, [view[start : start + step]], offset)
                    if got == 0:
                        break
                    if digest is not None and read_bytes:
                        digest.update(view[start : start + got])
                    offset += got
            finally:
                os.close(fd)
            if digest is not None and not read_bytes:
                out = memoryview(outs[slot])
                for lo in range(0, min(offset, len(view)), HASH_SLICE_BYTES):
                    hi = min(offset, lo + HASH_SLICE_BYTES)
                    out[lo:hi] = view[lo:hi]
                    digest.update(out[lo:hi])
        finally:
            with lock:
                free.append(slot)

    with ThreadPoolExecutor(inflight) as pool:
        list(pool.map(read, paths))


def cold_speeds(paths: Sequence[str], forms: Sequence[bool], read_bytes: int | None = None,
                inflight: Sequence[int] = INFLIGHT, verify: bool = False) -> dict[bool, dict[int, float]]:
    """GB/s reading ``paths`` cold at each number of reads in flight, per form (True: O_DIRECT,
    whole files; False: buffered, in ``read_bytes`` calls), the forms in turns; with
    ``verify``, hashing (and copying out of the staging buffer) as the disk tier does, so a
    form is judged by what its reads cost the tier. A form ``paths`` cannot be opened with
    (O_DIRECT refused) gets {}."""
    total = sum(os.path.getsize(p) for p in paths)
    speeds: dict[bool, dict[int, float]] = {form: {} for form in forms}
    usable = [form for form in forms if not form or direct_supported(paths[0])]
    buffers = read_buffers(paths, max(inflight))  # outside the timing
    outs = read_buffers(paths, max(inflight)) if verify and True in usable else None  # O_DIRECT's copy out
    for n in inflight:
        for form in usable:
            drop_cache(paths)
            t = time.perf_counter()
            read_all(paths, n, form, None if form else read_bytes, buffers, verify, outs)
            speeds[form][n] = total / (time.perf_counter() - t) / 1e9
    return speeds


def read_form(root: str, direct: bool | None = None, temp_suffix: str = ".tmp",
              read_bytes: int | None = None) -> tuple[bool, int]:
    """(O_DIRECT?, reads in flight) that read cold files on the device holding ``root``
    fastest: buffered (in calls of ``read_bytes``, whole if None, as the tier reads) if
    ``direct`` is False, O_DIRECT if True, the faster of both if None. Each form is measured
    once per device and process, the two in turns (the device's speed drifts), and kept in
    ``root`` for later starts; (False, ``FALLBACK``) where cold reads cannot be measured."""
    forms = (False, True) if direct is None else (direct,)
    with _lock:
        speeds = _speeds(root, forms, temp_suffix, read_bytes)
    tried = [(gbps, form, n) for form in forms for n, gbps in speeds.get(form, {}).items()]
    if not tried:
        return bool(direct), FALLBACK
    _, form, n = max(tried)
    return form, n


def read_parallelism(root: str, direct: bool = False, temp_suffix: str = ".tmp", read_bytes: int | None = None) -> int:
    """Best cold reads in flight of one form (``read_form`` with ``direct`` given)."""
    return read_form(root, direct, temp_suffix, read_bytes)[1]


def _speeds(root: str, forms: Sequence[bool], temp_suffix: str, read_bytes: int | None) -> dict[bool, dict[int, float]]:
    """GB/s per form and reads in flight: this process's, else the data directory's, else
    measured now (the forms missing), and saved (lock held)."""
    device = os.stat(root).st_dev
    known = _measured.setdefault(device, {})
    saved = os.path.join(root, RESULT_NAME)
    if any(form not in known for form in forms):
        try:
            with open(saved) as f:
                data = json.load(f)
            if data.get("version") == PROBE_VERSION:
                for form in forms:
                    table = data["gbps"].get(str(form).lower())
                    if table is not None and form not in known:
                        known[form] = {int(n): float(g) for n, g in table.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    missing = [form for form in forms if form not in known]
    if missing:
        known.update(_probe(root, missing, temp_suffix, read_bytes))
        try:
            with open(saved, "w") as f:
                json.dump({"version": PROBE_VERSION,
                           "gbps": {str(form).lower(): {str(n): g for n, g in table.items()}
                                    for form, table in known.items()}}, f)
        except OSError:
            pass
    return known


def _probe(root: str, forms: Sequence[bool], temp_suffix: str, read_bytes: int | None) -> dict[bool, dict[int, float]]:
    """GB/s reading probe files cold at each of ``INFLIGHT`` reads in flight, per form (True:
    O_DIRECT, whole files; False: buffered, in ``read_bytes`` calls), the forms in turns. A
    form that cannot be measured (a tmpfs keeps pages cached, O_DIRECT refused) gets {}."""
    # temporary names: a crash mid-probe leaves files the tier removes at its next start
    paths = [os.path.join(root, f"read-probe-{os.getpid()}-{i}{temp_suffix}") for i in range(PROBE_FILES)]
    try:
        block = os.urandom(PROBE_FILE_BYTES)
        for p in paths:
            with open(p, "wb") as f:
                f.write(block)
        speeds = cold_speeds(paths, forms, read_bytes, verify=True)
        log.info("%s: cold reads, GB/s by reads in flight: %s", root, "; ".join(
            f"{'O_DIRECT' if form else 'buffered'} " + ", ".join(f"{n}: {g:.2f}" for n, g in table.items())
            for form, table in speeds.items() if table))
        return speeds
    except (OSError, StillCached) as exc:
        log.info("%s: cold reads cannot be measured (%s); %d reads in flight, buffered", root, exc, FALLBACK)
        return {form: {} for form in forms}
    finally:
        for p in paths:
            try:
                os.unlink(p)
            except OSError:
                pass


def direct_supported(path: str) -> bool:
    """Whether ``path``'s file system opens files with O_DIRECT (a tmpfs refuses it)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
