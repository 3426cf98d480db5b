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

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, Sequence

import numpy as np

PARALLEL_MIN_BYTES = 4 << 20
SLICE_ALIGN = 4096

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


def _submit(groups: list[list[tuple[np.ndarray, np.ndarray]]]) -> list:
    """Hand ``groups`` to the copy threads; if a hand-off fails, wait for those handed out
    before raising (nothing may touch the buffers once the caller has its answer)."""
    futures = []
    try:
        for g in groups:
            futures.append(_executor().submit(_copy_group, g))
    except BaseException:
        wait(futures)
        raise
    return futures


def _raise_first(futures: list) -> None:
    for f in futures:
        f.result()


def _run(groups: list[list[tuple[np.ndarray, np.ndarray]]]) -> None:
    futures = _submit(groups[1:])
    try:
        _copy_group(groups[0])
    finally:
        wait(futures)  # every slice, even when one failed, before the buffers go back
    _raise_first(futures)  # then the first failure, if any


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
            _run(split(pairs, _workers))
        finally:
            _busy.release()
        return
    for dst, src in pairs:
        np.copyto(dst, src)


def copy_behind(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> Callable[[], None]:
    """Start copying ``pairs`` on the copy threads, and return ``wait()``, which returns once
    every one is written (call it exactly once, before either buffer is used or given back,
    also when the caller's own work failed). The caller works meanwhile: a put copies and
    hashes the first part of a payload while the threads copy the rest. Where there are no
    copy threads, or another copy holds them, the pairs are copied here, now."""
    if not pairs:
        return lambda: None
    if _workers == 1 or not _busy.acquire(blocking=False):
        _copy_group(list(pairs))
        return lambda: None
    try:
        futures = _submit(split(pairs, _workers - 1))
    except BaseException:
        _busy.release()
        raise

    def wait_all() -> None:
        try:
            wait(futures)
        finally:
            _busy.release()
        _raise_first(futures)

    return wait_all


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for two uint8 arrays of one size, on all cores when big."""
    copy_pairs([(dst, src)])
