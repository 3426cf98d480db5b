"""The reads of one Get: run ahead in executor threads, handed over in order, and fenced.

A read runs in an executor thread and may be writing into a client's slot, or may come back
holding host-pool pages pinned or a pooled buffer. So nothing a read touches is let go
before its thread is done: each read awaits its executor future through ``kvstore.wire.fence``
(even when the Get is cancelled: a client that hung up, a deadline), what an abandoned read
returned is released, and ``ReadAhead.close`` waits for every read it started. Cancelling the
task alone would leave the thread writing into a slot the client may already be reusing.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np


@dataclass
class Read:
    """One chunk read for a Get: where its bytes are and what to release once it is sent."""

    nbytes: int
    data: object = None  # bytes to send (a pooled buffer, or a blob's parts); None: in its slot or pool_runs
    pool_runs: list[tuple[int, int]] | None = None  # pinned in the host pool, (offset, length)
    release: Callable[[], object] | None = None  # unpins pool_runs
    pooled: np.ndarray | None = None  # give back to the buffer pool
    index: int = 0


class ReadAhead:
    """Reads ``count`` chunks, at most ``depth`` at once, handing them over in order.

    ``ready`` are the reads of the first chunks, done already (a Get pins the leading chunks
    that lie raw in host RAM in one executor call); ``start(i)`` reads chunk ``i`` (a
    coroutine returning a Read, or None on a miss); ``done(read)`` releases what a read
    holds. ``close`` waits for every read started and releases the results nobody took."""

    def __init__(self, count: int, depth: int, start: Callable[[int], Awaitable[Read | None]],
                 done: Callable[[Read], None], ready: list[Read] = ()) -> None:
        self._count, self._depth, self._start, self._done = count, max(1, depth), start, done
        self._ready = collections.deque(ready)
        self._pending: collections.deque[asyncio.Task] = collections.deque()
        self._queued = len(self._ready)

    def _refill(self) -> None:
        while self._queued < self._count and len(self._pending) < self._depth:
            self._pending.append(asyncio.ensure_future(self._start(self._queued)))
            self._queued += 1

    async def next(self) -> Read | None:
        """The next chunk's read (None on a miss, or when all were taken)."""
        if self._ready:
            if len(self._ready) <= self._depth:
                self._refill()
            return self._ready.popleft()
        self._refill()
        if not self._pending:
            return None
        task = self._pending.popleft()
        try:
            read = await task
        except BaseException:
            self._pending.appendleft(task)  # close() fences it
            raise
        self._refill()
        return read

    async def close(self) -> None:
        while self._ready:
            self._done(self._ready.popleft())
        pending, self._pending = self._pending, collections.deque()
        cancelled = False
        for task in pending:
            while not task.done():
                try:
                    await asyncio.wait([task])
                except asyncio.CancelledError:
                    cancelled = True
            if not task.cancelled() and task.exception() is None and task.result() is not None:
                self._done(task.result())
        if cancelled:
            raise asyncio.CancelledError
