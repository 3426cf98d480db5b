"""Daemon time shared among tenants by their recent use of it: a light tenant first.

One daemon process serves every tenant with one interpreter (its event loop and executor
threads share one lock). The admission and key-rate limits bound what a tenant may ask; they
do not stop a tenant that asks within them without pause from taking as much of that
interpreter as it can, beside a tenant that needs it now (docs/daemon.md, "Attacks").

So each piece of a request's work (an executor call, a batch of keys bound on the event loop)
first takes a turn here, and what the tenant's requests took of the interpreter is charged to
it (kvstore/daemon/tenant_work.py). A tenant's *use* is that CPU time, decayed by half every
``half_life_s``; its *rate* is the share of one interpreter that use stands for. While other
tenants are active (a piece waiting or running, or one ended less than ``idle_s`` ago), a
tenant whose rate is more than its share (one interpreter divided among the active tenants)
waits before its next piece starts, until its rate is back within its share, the others are
idle, or ``max_wait_s`` passed (a bound on the delay, never a refusal). The wait is an await
on the event loop, so the tenant's closed-loop client waits too and frees the CPU; a tenant
within its share never waits, and a tenant alone never does.

The share is of the interpreter, not of what the tenants used: a well-behaved tenant may use
more of it than an abusive one (a put and a get of 16 KiB in a loop takes ~35%, a flood held
to ``limits.max_keys_per_s_per_tenant`` ~10%), and must not be paced for it.

Used only from the event loop thread.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from contextlib import asynccontextmanager
from typing import Callable

from kvstore.daemon.metrics import DaemonMetrics


class TenantScheduler:
    def __init__(self, half_life_s: float, idle_s: float, max_wait_s: float, metrics: DaemonMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.half_life_s, self.idle_s, self.max_wait_s, self.clock = half_life_s, idle_s, max_wait_s, clock
        self.metrics = metrics
        self._use: dict[str, tuple[float, float]] = {}  # tenant label -> (seconds used, when)
        self._busy: Counter[str] = Counter()  # pieces waiting or running
        self._ended: dict[str, float] = {}  # when the tenant's last piece ended
        self._pacers: dict[str, asyncio.Lock] = {}  # per tenant: held by the one piece of it that waits
        self.delayed = 0  # pieces that waited

    def use(self, label: str) -> float:
        """``label``'s daemon seconds, decayed to now."""
        seconds, at = self._use.get(label, (0.0, 0.0))
        return seconds * 0.5 ** ((self.clock() - at) / self.half_life_s) if seconds else 0.0

    def charge(self, label: str, seconds: float) -> None:
        """Count ``seconds`` of daemon time against ``label``."""
        self._use[label] = (self.use(label) + seconds, self.clock())

    def active(self, label: str) -> bool:
        return bool(self._busy[label]) or self.clock() - self._ended.get(label, -float("inf")) < self.idle_s

    def rate(self, label: str) -> float:
        """The share of one interpreter ``label``'s use stands for: a tenant that used ``r`` of
        it for a long time has a use of ``r * half_life_s / ln 2``."""
        return self.use(label) * math.log(2) / self.half_life_s

    def must_wait(self, label: str) -> bool:
        """Whether a piece of ``label`` waits now: its rate is over its share while another
        tenant is active."""
        others = sum(1 for t in self._busy.keys() | self._ended.keys() if t != label and self.active(t))
        return others > 0 and self.rate(label) > 1 / (others + 1)

    @asynccontextmanager
    async def turn(self, label: str):
        """Wait until a piece of ``label``'s work may start, and hold its place while it runs;
        the caller charges what it took."""
        self._busy[label] += 1
        try:
            if self.must_wait(label):
                self.delayed += 1
                if self.metrics is not None:
                    self.metrics.scheduler_waits.labels(label).inc()
                await self._wait(label)
            yield
        finally:
            self._busy[label] -= 1
            if not self._busy[label]:
                del self._busy[label]
            self._ended[label] = self.clock()

    async def _wait(self, label: str) -> None:
        """Sleep until ``label``'s rate is back within its share, the others are idle, or
        ``max_wait_s`` passed. Only time ends a wait (another tenant's use or work never
        lowers this one's rate), so the waiter sleeps until then (looking again at least every
        ``idle_s`` while another tenant has work in flight), and one piece of a tenant waits
        at a time, its later pieces behind it: the waiting itself must not take the event
        loop from the tenants it makes room for."""
        deadline = self.clock() + self.max_wait_s
        async with self._pacers.setdefault(label, asyncio.Lock()):
            while self.must_wait(label):
                left = deadline - self.clock()
                if left <= 0:
                    return
                await asyncio.sleep(min(left, self._next_idle(label), self._within_share(label)))

    def _next_idle(self, label: str) -> float:
        """Seconds until the soonest other tenant without a piece in flight stops being active."""
        now = self.clock()
        left = [end + self.idle_s - now for t, end in self._ended.items() if t != label and not self._busy[t]]
        return max(0.0, min((s for s in left if s > 0), default=self.idle_s))

    def _within_share(self, label: str) -> float:
        """Seconds until ``label``'s rate decays to its share, the active tenants as they are."""
        active = sum(1 for t in self._busy.keys() | self._ended.keys() if self.active(t))
        rate, share = self.rate(label), 1 / max(1, active)
        return self.half_life_s * math.log2(rate / share) if rate > share else 0.0
