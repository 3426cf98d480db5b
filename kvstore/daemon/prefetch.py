"""Promotions started by Prefetch: bounded and deduplicated on the daemon's side.

A key already being promoted is not started again, and at most ``max_total`` promotions (at
most ``max_per_tenant`` of one tenant) run at once; keys beyond that are not started, and the
reply's count says how many were. So a client calling Prefetch(wait=false) in a loop queues
nothing more than that, whatever it sends. Bookkeeping on the event loop thread; the Store's
futures report back through it.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from concurrent.futures import Future
from typing import Awaitable, Callable, Sequence

from kvstore.daemon.identity import Tenant
from kvstore.keys import ChunkKey


class Prefetches:
    def __init__(self, max_total: int, max_per_tenant: int) -> None:
        self.max_total, self.max_per_tenant = max_total, max_per_tenant
        self._running: dict[bytes, Future] = {}
        self._per_tenant: Counter[str] = Counter()

    @property
    def running(self) -> int:
        return len(self._running)

    async def start(self, tenant: Tenant, keys: Sequence[ChunkKey],
                    prefetch: Callable[[list[ChunkKey]], Awaitable[list[Future | None]]]) -> list[Future]:
        """Promotions of ``keys`` started now or already running; ``prefetch(keys)`` starts
        them (one future, or None where there was nothing to promote, per key)."""
        loop = asyncio.get_running_loop()
        wanted, futures = [], []
        for key in dict.fromkeys(keys):
            if key.id in self._running:
                futures.append(self._running[key.id])
            elif len(self._running) + len(wanted) < self.max_total and \
                    self._per_tenant[tenant.label] + len(wanted) < self.max_per_tenant:
                wanted.append(key)
        if not wanted:
            return futures
        for key, future in zip(wanted, await prefetch(wanted)):
            if future is None or key.id in self._running:
                continue
            self._running[key.id] = future
            self._per_tenant[tenant.label] += 1
            futures.append(future)
            future.add_done_callback(lambda _, key_id=key.id, label=tenant.label:
                                     loop.call_soon_threadsafe(self._done, key_id, label))
        return futures

    def _done(self, key_id: bytes, label: str) -> None:
        if self._running.pop(key_id, None) is not None:
            self._per_tenant[label] -= 1
