"""Keys per second a tenant's requests may name: a token bucket per tenant.

Every key a request names costs the daemon work in its interpreter before the Store is asked
(binding it to the tenant's namespace, looking it up, pinning it): about a microsecond each,
whether the chunk exists or not. Bounded only per request, a tenant sending back-to-back
Pauses of 4,096 random keys took most of the daemon's interpreter, and another tenant's
P99 latency grew 42-fold. Counted per tenant, before any of that work:

- a tenant gets ``keys_per_s``, after a burst of a quarter of a second of them (or of one
  request of ``max_keys_per_request`` keys, if that is more);
- a request past that waits for its keys, up to ``MAX_WAIT_S`` (the keys are its then: later
  requests wait behind it), so a client that sends one request after another is slowed to
  the rate and refused nothing;
- a request that would wait longer is refused with RESOURCE_EXHAUSTED naming the setting,
  after waiting ``MAX_WAIT_S`` all the same: refused at once, a flood came straight back,
  and beside ~290 refusals a second another tenant still lost 40% of its throughput.

Used only from the event loop thread.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import grpc

from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.daemon.metrics import DaemonMetrics

SETTING = "limits.max_keys_per_s_per_tenant"
MAX_WAIT_S = 1.0


class KeyRate:
    def __init__(self, keys_per_s: int, max_keys_per_request: int, metrics: DaemonMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keys_per_s, self.metrics, self.clock = keys_per_s, metrics, clock
        self.burst = max(keys_per_s // 4, max_keys_per_request)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant label -> (keys left, when); below 0: owed

    async def take(self, tenant: Tenant, keys: int) -> None:
        """Spend ``keys`` of ``tenant``'s budget, waiting for them up to ``MAX_WAIT_S``; Fail
        RESOURCE_EXHAUSTED, spending nothing, if they would take longer to come."""
        now = self.clock()
        left, then = self._buckets.get(tenant.label, (self.burst, now))
        left = min(self.burst, left + (now - then) * self.keys_per_s)
        wait = (keys - left) / self.keys_per_s
        if wait > MAX_WAIT_S:
            self._buckets[tenant.label] = (left, now)
            self.metrics.shed.labels("keys_per_s").inc()
            await asyncio.sleep(MAX_WAIT_S)
            raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{keys} keys asked, {max(0, int(left))} left of this tenant's {SETTING} = {self.keys_per_s} "
                       f"(bursts of {self.burst}); retry later")
        self._buckets[tenant.label] = (left - keys, now)
        if wait > 0:
            await asyncio.sleep(wait)
