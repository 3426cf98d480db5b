"""Big host-memory copies split in slices over a small persistent pool of threads.

One thread of ``memmove`` does not reach the memory bandwidth of a machine with several
cores; ``np.copyto`` releases the GIL, so slices of one copy run on all cores at once. The
pool is created on first use and lives as long as the process (a pool per call would cost
more than the copy). Copies below ``PARALLEL_MIN_BYTES`` stay in the caller's thread, where
handing slices to workers costs more than it saves, and so does a copy that starts while
another one holds the pool: the cores are busy copying already, and its slices would wait
behind the other copy's.

A copy returns only when every slice is written: nothing touches either buffer afterwards.
"""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import numpy as np

PARALLEL_MIN_BYTES = 4 << 20
SLICE_ALIGN = 4096
SEAL_SLICE_BYTES = 256 << 10  # a slice just copied is still in L2 when it is hashed

_lock = threading.Lock()
_busy = threading.Lock()  # held by the copy that has the pool
_pool: ThreadPoolExecutor | None = None
_start_lock = threading.Lock()
_started = False  # every worker of ``_pool`` has been started (``start``)
_workers = max(1, os.cpu_count() or 1)


def workers() -> int:
    """Threads a copy is split over (the caller's included)."""
    return _workers


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_workers - 1, thread_name_prefix="parallel-copy")
        return _pool


def start() -> None:
    """Start every worker now, in the caller's thread: a thread inherits its starter's
    scheduling priority, and one started lazily by a low-priority thread (a copy written
    behind) would slow every later copy of the callers'. Once per process: two calls at once
    would split the pool between their barriers, and both wait out the timeout."""
    global _started
    if _workers == 1:
        return
    with _start_lock:
        if _started:
            return
        pool = _executor()
        barrier = threading.Barrier(_workers - 1)
        # each waits until all have started, so no worker is reused: the pool starts them all
        wait([pool.submit(barrier.wait, 10) for _ in range(_workers - 1)])
        _started = True


def _copy_group(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in group:
        np.copyto(dst, src)


def _run_tasks(tasks: list[Callable[[], None]]) -> None:
    """Run the first task here and the others on the copy threads; return once every one has
    ended, even when one failed (nothing may touch the buffers once the caller has its
    answer), then raise the first failure, if any."""
    futures = []
    try:
        try:
            for task in tasks[1:]:
                futures.append(_executor().submit(task))
        finally:
            if len(futures) == len(tasks) - 1:
                tasks[0]()
    finally:
        wait(futures)
    for f in futures:
        f.result()


def split(pairs: Sequence[tuple[np.ndarray, np.ndarray]], parts: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """(dst, src) byte-array pairs regrouped into ``parts`` groups of about equal bytes, cut
    at ``SLICE_ALIGN`` boundaries; the groups together copy exactly the same bytes."""
    total = sum(src.size for _, src in pairs)
    share = max(SLICE_ALIGN, -(-total // parts // SLICE_ALIGN) * SLICE_ALIGN)
    groups: list[list] = [[]]
    room = share
    for dst, src in pairs:
        done = 0
        while done < src.size:
            if room == 0:
                groups.append([])
                room = share
            take = min(room, src.size - done)
            groups[-1].append((dst[done : done + take], src[done : done + take]))
            done += take
            room -= take
    return groups


def copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    """Copy every ``src`` into its ``dst`` (uint8 arrays of equal sizes), on all cores when big."""
    total = sum(src.size for _, src in pairs)
    if total >= PARALLEL_MIN_BYTES and _workers > 1 and _busy.acquire(blocking=False):
        try:
            _run_tasks([functools.partial(_copy_group, g) for g in split(pairs, _workers)])
        finally:
            _busy.release()
        return
    for dst, src in pairs:
        np.copyto(dst, src)


def leaves_of(pairs: Sequence[tuple[np.ndarray, np.ndarray]], leaf_bytes: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """(dst, src) pairs that together copy one stream of bytes (a payload), cut at each
    multiple of ``leaf_bytes`` of that stream: each leaf's pairs, in order."""
    leaves: list[list] = [[]]
    room = leaf_bytes
    for dst, src in pairs:
        done = 0
        while done < src.size:
            if room == 0:
                leaves.append([])
                room = leaf_bytes
            take = min(room, src.size - done)
            leaves[-1].append((dst[done : done + take], src[done : done + take]))
            done += take
            room -= take
    return leaves if leaves[0] else []


def copy_hashing(pairs: Sequence[tuple[np.ndarray, np.ndarray]], digest) -> None:
    """Copy (dst, src) pairs that together copy one stream (a payload) and feed ``digest``
    the copies, each slice right after it lands, while it is in cache (the digest is of what
    ``dst`` holds). A digest with leaves (``leaf_bytes``, ``leaf_checksum``, ``extend``:
    kvstore/blob.py's ``TreeDigest``) has its leaves hashed on the copy threads too, when the
    stream is big; one without (``leaf_bytes`` 0) is fed in order, on this thread.

    Returns only when every slice is written: nothing touches either buffer afterwards."""
    if not digest.leaf_bytes:
        for leaf in leaves_of(pairs, SEAL_SLICE_BYTES):
            for dst, src in leaf:
                np.copyto(dst, src)
                digest.update(dst)
        return
    leaves = leaves_of(pairs, digest.leaf_bytes)
    sums = [0] * len(leaves)

    def run(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            for dst, src in leaves[i]:
                np.copyto(dst, src)
            sums[i] = digest.leaf_checksum([dst for dst, _ in leaves[i]])

    total = sum(src.size for _, src in pairs)
    if total >= PARALLEL_MIN_BYTES and _workers > 1 and len(leaves) > 1 and _busy.acquire(blocking=False):
        try:
            cuts = [len(leaves) * k // _workers for k in range(_workers + 1)]
            _run_tasks([functools.partial(run, lo, hi) for lo, hi in zip(cuts, cuts[1:]) if lo < hi])
        finally:
            _busy.release()
    else:
        run(0, len(leaves))
    digest.extend(sums)


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for two uint8 arrays of one size, on all cores when big."""
    copy_pairs([(dst, src)])
