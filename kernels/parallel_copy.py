"""Big host-memory copies split in slices over a small persistent pool of threads.

One thread of ``memmove`` does not reach the memory bandwidth of a machine with several
cores; ``np.copyto`` releases the GIL, so slices of one copy run on all cores at once. The
pool is created on first use (or by ``start``) and lives as long as the process (a pool per
call would cost more than the copy). Copies below ``PARALLEL_MIN_BYTES`` stay in the caller's
thread, where handing slices to workers costs more than it saves, and so does a copy that
starts while another one holds the pool: the cores are busy copying already, and its slices
would wait behind the other copy's.

A worker is handed its slice through a lock it sleeps on and hands it back through another:
no queue, future or condition variable between the copy and the threads, whose wake-ups cost
~100 us of a 5.6 MiB copy's ~400 through a ``ThreadPoolExecutor``. Only the copy that holds
the pool (``_busy``) hands out work, so each worker has one task slot.

A copy that asks for a team (``team=True``: a Store's read from host RAM) goes instead to
torch's ``copy_`` when it runs on the main thread of a process that runs torch on several
threads: that thread's OpenMP team spins between parallel regions where ours sleep, and on a
guest whose idle vCPU wakes in ~30-150 us that costs ~20% of a 5.6 MiB read. Only the main
thread: an engine's forward runs on its team already, and a team started by another thread
would spin beside it (docs/vllm.md). Never in a forked child (``_reset_after_fork``). Not a
client's copy out of a daemon's pool: on 2 cores the spinning team held a core the daemon
needed next (a Get of 8 x 4 MiB: 9.5 -> 7.9 GB/s). And not while the machine has more
runnable threads than cores: a team's copy waits for its slowest thread, and one the
scheduler took off its core costs the whole copy a time slice (5.6 MiB with three busy
processes beside it on 2 cores: P50 0.2-12 ms, P90 12-16 ms, against 0.3 and 0.4-3.9 on
the copy threads). A copy slower than ``TEAM_SLOW_BYTES_PER_S`` sends the next ones to the
copy threads for ``TEAM_BACKOFF_S``.

A copy returns only when every slice is written: nothing touches either buffer afterwards.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from typing import Callable, Sequence

import numpy as np

# below these, one thread copies faster than all (the hand-off costs more than it saves).
# Measured on 2 cores, Store gets and puts of 3 MiB chunks, in turns: all cores made a get
# from host RAM 8% faster (9.04 -> 9.76 GB/s) and a put (a copy that hashes) 9% slower.
PARALLEL_MIN_BYTES = 3 << 20
PARALLEL_HASHING_MIN_BYTES = 4 << 20
SLICE_ALIGN = 4096
TEAM_MIN_BYTES = 64 << 10  # a smaller pair of a big copy is copied here, not by torch's team
# a team's copy slower than this lost a thread to the scheduler (a quiet one copies at 15-28
# GB/s; one that lost a time slice, 0.4-1.5), if it took longer than a time slice at all;
# then the copy threads copy for a while
TEAM_SLOW_BYTES_PER_S = 2e9
TEAM_SLICE_S = 1e-3
TEAM_BACKOFF_S = 1.0
SEAL_SLICE_BYTES = 256 << 10  # a slice just copied is still in L2 when it is hashed

_lock = threading.Lock()  # guards the pool's creation
_busy = threading.Lock()  # held by the copy that has the pool
_workers = max(1, os.cpu_count() or 1)


class _Worker:
    """A copy thread with one task slot: ``hand`` wakes it, ``join`` waits for the end."""

    def __init__(self, name: str) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._task: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            try:
                self._task()
            except BaseException as exc:  # the copy that handed it raises it
                self._error = exc
            self._task = None
            self._done.release()

    def hand(self, task: Callable[[], None]) -> None:
        self._task = task
        self._go.release()

    def join(self) -> BaseException | None:
        """Wait until the task handed is done; what it raised, if anything."""
        self._done.acquire()
        error, self._error = self._error, None
        return error


_pool: list[_Worker] | None = None
_forked = False  # this process is a forked child (``_reset_after_fork``)
_team_off_until = 0.0  # time.monotonic() until which copies that ask for a team go to the copy threads


def _reset_after_fork() -> None:
    """A forked child has none of the parent's threads, and a lock a copy held stays held.
    Nor does it copy on torch's team: GNU OpenMP's team never starts in a child forked after
    the parent's ran (a torch ``copy_`` there hangs), and whether it ran cannot be asked."""
    global _pool, _busy, _lock, _forked
    _pool, _busy, _lock, _forked = None, threading.Lock(), threading.Lock(), True


os.register_at_fork(after_in_child=_reset_after_fork)


def workers() -> int:
    """Threads a copy is split over (the caller's included)."""
    return _workers


def _threads() -> list[_Worker]:
    global _pool
    with _lock:
        if _pool is None:
            _pool = [_Worker(f"parallel-copy_{i}") for i in range(_workers - 1)]
        return _pool


def start() -> None:
    """Start every worker now, in the caller's thread: a thread inherits its starter's
    scheduling priority, and one started lazily by a low-priority thread (a copy written
    behind) would slow every later copy of the callers'."""
    if _workers > 1:
        _threads()


def _copy_group(group: list[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in group:
        np.copyto(dst, src)


def _run_tasks(tasks: list[Callable[[], None]]) -> None:
    """Run the first task here and hand the others to the copy threads (the caller holds
    ``_busy``; tasks beyond the threads run here too); return once every one has ended, even
    when one failed (nothing may touch the buffers once the caller has its answer), then
    raise the first failure, if any."""
    handed = _threads()[: len(tasks) - 1]
    for worker, task in zip(handed, tasks[1:]):
        worker.hand(task)
    try:
        for task in [tasks[0], *tasks[1 + len(handed) :]]:
            task()
    finally:
        errors = [_join(worker) for worker in handed]
    for error in errors:
        if error is not None:
            raise error


def _join(worker: _Worker) -> BaseException | None:
    """``worker.join()``; if that wait is interrupted (a signal's exception), the pool is
    given up: a later copy must not take this task's end for its own."""
    global _pool
    try:
        return worker.join()
    except BaseException:
        with _lock:
            _pool = None
        raise


def split(pairs: Sequence[tuple[np.ndarray, np.ndarray]], parts: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """(dst, src) byte-array pairs regrouped into ``parts`` groups of about equal bytes, cut
    at ``SLICE_ALIGN`` boundaries; the groups together copy exactly the same bytes."""
    total = sum(src.size for _, src in pairs)
    return _cut(pairs, max(SLICE_ALIGN, -(-total // parts // SLICE_ALIGN) * SLICE_ALIGN)) or [[]]


def _cut(pairs: Sequence[tuple[np.ndarray, np.ndarray]], share: int) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """(dst, src) pairs that together copy one stream of bytes, cut at each multiple of
    ``share`` of that stream: each group's pairs, in order (none for no bytes)."""
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
    return groups if groups[0] else []


def _torch_team():
    """torch, where this thread's copies that ask for a team go to its OpenMP team (the
    module docstring); else None. A process that never imported torch has no team, and a
    forked child none it may use."""
    torch = sys.modules.get("torch")
    if (_forked or torch is None or threading.current_thread() is not threading.main_thread()
            or torch.get_num_threads() < 2 or time.monotonic() < _team_off_until):
        return None
    return torch


def _copy_on_team(torch, pairs: Sequence[tuple[np.ndarray, np.ndarray]], total: int) -> None:
    """Copy on the team; a copy slower than ``TEAM_SLOW_BYTES_PER_S`` (and longer than
    ``TEAM_SLICE_S``) sends the next ones to the copy threads for ``TEAM_BACKOFF_S`` (only
    the main thread writes ``_team_off_until``)."""
    global _team_off_until
    started = time.monotonic()
    _copy_pairs_on_team(torch, pairs)
    ended = time.monotonic()
    if ended - started > max(TEAM_SLICE_S, total / TEAM_SLOW_BYTES_PER_S):
        _team_off_until = ended + TEAM_BACKOFF_S


def _copy_pairs_on_team(torch, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
    for dst, src in pairs:
        if src.size < TEAM_MIN_BYTES or not (dst.flags.writeable and src.flags.writeable):
            np.copyto(dst, src)  # torch views only writable arrays; np.copyto refuses a read-only dst
        else:
            torch.from_numpy(dst).copy_(torch.from_numpy(src))


def copy_pairs(pairs: Sequence[tuple[np.ndarray, np.ndarray]], team: bool = False) -> None:
    """Copy every ``src`` into its ``dst`` (uint8 arrays of equal sizes), on all cores when big:
    on torch's OpenMP team where ``team`` and this thread has one (the module docstring), else
    on the copy threads."""
    total = sum(src.size for _, src in pairs)
    if team and total >= PARALLEL_MIN_BYTES and (torch := _torch_team()) is not None:
        _copy_on_team(torch, pairs, total)
        return
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
    return _cut(pairs, leaf_bytes)


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

    def leaf(i: int) -> None:
        for dst, src in leaves[i]:
            np.copyto(dst, src)
        sums[i] = digest.leaf_checksum([dst for dst, _ in leaves[i]])

    total = sum(src.size for _, src in pairs)
    if total >= PARALLEL_HASHING_MIN_BYTES and _workers > 1 and len(leaves) > 1 and _busy.acquire(blocking=False):
        try:
            _share_out(len(leaves), leaf)
        finally:
            _busy.release()
    else:
        for i in range(len(leaves)):
            leaf(i)
    digest.extend(sums)


def _share_out(n: int, do: Callable[[int], None]) -> None:
    """``do(i)`` for each i in ``range(n)``, on this thread and the copy threads (the caller
    holds ``_busy``): this thread takes items from the front, the copy threads from the back,
    and they leave the last item to it. Why: a copy thread starts 15-30 us after the caller,
    so with even shares the caller ended first and slept until it was woken, another 25-45
    us (5.6 MiB hashed as copied, in turns: 2.8-4.9% faster than halves)."""
    claim = threading.Lock()
    ends = [0, n]  # the next item from the front, one past the next from the back

    def front() -> None:
        while True:
            with claim:
                if ends[0] >= ends[1]:
                    return
                i = ends[0]
                ends[0] += 1
            do(i)

    def back() -> None:
        while True:
            with claim:
                if ends[1] - ends[0] <= 1:
                    return
                ends[1] -= 1
                i = ends[1]
            do(i)

    _run_tasks([front] + [back] * (_workers - 1))


def copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``np.copyto(dst, src)`` for two uint8 arrays of one size, on all cores when big."""
    copy_pairs([(dst, src)])
