"""Daemon time shared among tenants by their recent use of it: a light tenant first.

One daemon process serves every tenant with one interpreter (its event loop and executor
threads share one lock). The admission and key-rate limits bound what a tenant may ask; they
do not stop a tenant that asks within them without pause from getting as much of that
interpreter as a tenant that needs it now: beside such a tenant a well-behaved one's P99 grew
2-4.5x and its operations per second halved (docs/daemon.md, "Attacks").

So each piece of a request's work (an executor call, a batch of keys bound on the event loop)
first takes a turn here, and what it took is charged to its tenant. A tenant's *use* is that
daemon time, decayed by half every ``half_life_s``. A tenant waits before its next piece
starts, while another tenant is active (has a piece waiting or running, or ended one less
than ``idle_s`` ago), if

- its use is more than its share, the active tenants' use divided among them, or
- a tenant that used less has a piece waiting or running (the light tenant goes first).

The wait is an await on the event loop, so the tenant's closed-loop client waits too and frees
the CPU; it ends when the others' pieces or their idleness let the tenant go, or after
``max_wait_s`` (a bound on the delay, never a refusal). A tenant alone is never delayed.

Used only from the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from contextlib import asynccontextmanager
from typing import Callable


class TenantScheduler:
    def __init__(self, half_life_s: float, idle_s: float, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s, self.idle_s, self.max_wait_s, self.clock = half_life_s, idle_s, max_wait_s, clock
        self._use: dict[str, tuple[float, float]] = {}  # tenant label -> (seconds used, when)
        self._busy: Counter[str] = Counter()  # pieces waiting or running
        self._ended: dict[str, float] = {}  # when the tenant's last piece ended
        self._changed = asyncio.Event()  # set, and replaced, when a use or a busy count changes
        self.delayed = 0  # pieces that waited

    def use(self, label: str) -> float:
        """``label``'s daemon seconds, decayed to now."""
        seconds, at = self._use.get(label, (0.0, 0.0))
        return seconds * 0.5 ** ((self.clock() - at) / self.half_life_s) if seconds else 0.0

    def charge(self, label: str, seconds: float) -> None:
        """Count ``seconds`` of daemon time against ``label``."""
        self._use[label] = (self.use(label) + seconds, self.clock())
        self._wake()

    def active(self, label: str) -> bool:
        return bool(self._busy[label]) or self.clock() - self._ended.get(label, -float("inf")) < self.idle_s

    def must_wait(self, label: str) -> bool:
        """Whether a piece of ``label`` waits now (see the module's docstring)."""
        others = [t for t in self._busy.keys() | self._ended.keys() if t != label and self.active(t)]
        if not others:
            return False
        mine = self.use(label)
        theirs = {t: self.use(t) for t in others}
        if mine * (len(others) + 1) > mine + sum(theirs.values()):
            return True
        return any(self._busy[t] and used < mine for t, used in theirs.items())

    @asynccontextmanager
    async def turn(self, label: str):
        """Wait until a piece of ``label``'s work may start, and hold its place while it runs;
        the caller charges what it took."""
        self._busy[label] += 1
        try:
            if self.must_wait(label):
                self.delayed += 1
                await self._wait(label)
            yield
        finally:
            self._busy[label] -= 1
            if not self._busy[label]:
                del self._busy[label]
            self._ended[label] = self.clock()
            self._wake()

    async def _wait(self, label: str) -> None:
        deadline = self.clock() + self.max_wait_s
        while self.must_wait(label):
            left = deadline - self.clock()
            if left <= 0:
                return
            changed = self._changed
            try:
                async with asyncio.timeout(min(left, self._next_idle())):
                    await changed.wait()
            except TimeoutError:
                pass

    def _next_idle(self) -> float:
        """Seconds until the soonest tenant without a piece in flight stops being active."""
        now = self.clock()
        left = [end + self.idle_s - now for t, end in self._ended.items() if not self._busy[t]]
        return max(0.0, min((s for s in left if s > 0), default=self.idle_s))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
