"""Keys per second a tenant's requests may name: a token bucket per tenant.

Every key a request names costs the daemon work in its interpreter before the Store is asked
(binding it to the tenant's namespace, looking it up, pinning it): about a microsecond each,
whether the chunk exists or not. Bounded only per request, a tenant sending back-to-back
Pauses of 4,096 random keys took most of the daemon's interpreter, and another tenant's
P99 latency grew 42-fold. Counted per tenant, before any of that work, a flood is refused
with RESOURCE_EXHAUSTED at ``keys_per_s`` (after a burst of a quarter of a second, or of one
request of ``max_keys_per_request`` keys if that is more), and the rest of the daemon's time
stays the other tenants'. Used only from the event loop thread.
"""

from __future__ import annotations

import time
from typing import Callable

import grpc

from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.daemon.metrics import DaemonMetrics

SETTING = "limits.max_keys_per_s_per_tenant"


class KeyRate:
    def __init__(self, keys_per_s: int, max_keys_per_request: int, metrics: DaemonMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keys_per_s, self.metrics, self.clock = keys_per_s, metrics, clock
        self.burst = max(keys_per_s // 4, max_keys_per_request)
        self._buckets: dict[str, tuple[float, float]] = {}  # tenant label -> (keys left, when)

    def take(self, tenant: Tenant, keys: int) -> None:
        """Spend ``keys`` of ``tenant``'s budget; Fail RESOURCE_EXHAUSTED, spending nothing,
        when fewer are left."""
        now = self.clock()
        left, then = self._buckets.get(tenant.label, (self.burst, now))
        left = min(self.burst, left + (now - then) * self.keys_per_s)
        if keys > left:
            self._buckets[tenant.label] = (left, now)
            self.metrics.shed.labels("keys_per_s").inc()
            raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"{keys} keys asked, {int(left)} left of this tenant's {SETTING} = {self.keys_per_s} "
                       f"(bursts of {self.burst}); retry later")
        self._buckets[tenant.label] = (left - keys, now)
