"""Which Get's chunk read runs next: the daemon's chunk reads in flight are capped at its
executor's threads, and a free place goes to the earliest Get waiting for one.

Without it every Get kept its read-ahead queued in the executor, so the Gets of a burst took
turns chunk by chunk and every request of the burst ended near the burst's end (the cluster
model, bench/cluster_model.py, matched the daemon only as processor sharing). Served
earliest first, the first requests end sooner and the burst's makespan stays the same. A Get
still holds at most its read-ahead depth at once, so a large Get leaves places to the Gets
behind it, and no Get waits behind later ones (no starvation).

Everything runs on the daemon's event loop: no locks.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextlib import asynccontextmanager
from typing import AsyncIterator


class ReadGrants:
    def __init__(self, places: int) -> None:
        self.free = max(1, places)
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # (Get order, arrival, future)
        self._arrivals = itertools.count()
        self._gets = itertools.count()

    def next_get(self) -> int:
        """The order of a new Get: earlier Gets come first."""
        return next(self._gets)

    @property
    def waiting(self) -> int:
        return sum(not f.done() for _, _, f in self._waiting)

    @asynccontextmanager
    async def hold(self, order: int) -> AsyncIterator[None]:
        """A place for one chunk read of the Get ``order``, for the ``async with`` block."""
        await self._acquire(order)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, order: int) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (order, next(self._arrivals), future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release()  # the place came as we were cancelled: pass it on
            raise

    def _release(self) -> None:
        while self._waiting:
            _, _, future = heapq.heappop(self._waiting)
            if not future.done():  # a cancelled waiter's future is done already
                future.set_result(None)
                return
        self.free += 1
