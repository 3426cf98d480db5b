"""Which Get's chunk read runs next: the daemon's chunk reads in flight are capped at its
executor's threads; a free place goes to the tenant with the fewest reads running, and
within a tenant to its earliest Get waiting.

Without it every Get kept its read-ahead queued in the executor, so the Gets of a burst took
turns chunk by chunk and every request of the burst ended near the burst's end (the cluster
model, bench/cluster_model.py, matched the daemon only as processor sharing). Served
earliest first, the first requests end sooner and the burst's makespan stays the same. A Get
still holds at most its read-ahead depth at once, so a large Get leaves places to the Gets
behind it, and no Get waits behind later ones of its tenant (no starvation). Between tenants
the places are shared, not ordered by arrival: a tenant's burst does not queue another
tenant's Get behind all of it.

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
        self.running: dict[str, int] = {}  # tenant -> reads holding a place
        self._waiting: dict[str, list[tuple[int, int, asyncio.Future]]] = {}  # tenant -> (Get, arrival, future)
        self._arrivals = itertools.count()
        self._gets = itertools.count()

    def next_get(self) -> int:
        """The order of a new Get: a tenant's earlier Gets come first."""
        return next(self._gets)

    @property
    def waiting(self) -> int:
        return sum(not f.done() for heap in self._waiting.values() for _, _, f in heap)

    @asynccontextmanager
    async def hold(self, tenant: str, order: int) -> AsyncIterator[None]:
        """A place for one chunk read of ``tenant``'s Get ``order``, for the ``async with`` block."""
        await self._acquire(tenant, order)
        try:
            yield
        finally:
            self._release(tenant)

    async def _acquire(self, tenant: str, order: int) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            self.running[tenant] = self.running.get(tenant, 0) + 1
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting.setdefault(tenant, []), (order, next(self._arrivals), future))
        try:
            await future  # granted: counted as running by _release
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self._release(tenant)  # the place came as we were cancelled: pass it on
            raise

    def _release(self, tenant: str) -> None:
        self.running[tenant] -= 1
        if not self.running[tenant]:
            del self.running[tenant]
        while self._waiting:
            # the tenant with the fewest reads running; among equals, the one that asked first
            name = min(self._waiting, key=lambda t: (self.running.get(t, 0), self._waiting[t][0][1]))
            heap = self._waiting[name]
            _, _, future = heapq.heappop(heap)
            if not heap:
                del self._waiting[name]
            if not future.done():  # a cancelled waiter's future is done already
                self.running[name] = self.running.get(name, 0) + 1
                future.set_result(None)
                return
        self.free += 1
