"""A daemon-wide budget shared among tenants, part of it kept for tenants under their share.

Two of the daemon's resources are one number for the whole daemon: KVStore RPCs at once
(``limits.max_concurrent_streams``) and bytes of bulk frames being received
(``bulk.max_receive_bytes``). Taken first come, first served, one tenant could hold all of
either: ~260 Put streams that sent nothing refused every other tenant's calls, and the health
check, with RESOURCE_EXHAUSTED (an orchestrator's probe would then restart the daemon, and its
host-RAM cache is lost). So each is counted per tenant from the moment it is taken (an RPC
when it opens, a frame when it announces its size) and:

- the total never passes the limit (one request alone may, when nothing else holds any: a
  chunk is bounded by ``max_chunk_bytes`` anyway);
- a tenant's *share* is the limit divided among the tenants that may call; a tenant that
  would hold more than its share gets it only while ``reserved`` units stay free after it.
  Those are kept for tenants under their share, so the greedy tenant is refused, not the
  others.

Used only from the event loop thread.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import grpc

from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.daemon.metrics import DaemonMetrics


class FairShare:
    def __init__(self, limit: int, reserved: int, tenants: int, metrics: DaemonMetrics, *, what: str,
                 setting: str, reserve: str, shed_label: str) -> None:
        """``what`` names the unit in messages ("RPCs", "bytes"); ``setting`` and ``reserve``
        say which settings (or rule) set ``limit`` and ``reserved``."""
        self.limit, self.reserved, self.metrics = limit, reserved, metrics
        self.share = max(1, limit // max(1, tenants))
        self.what, self.setting, self.reserve, self.shed_label = what, setting, reserve, shed_label
        self.used = 0
        self._held: Counter[str] = Counter()

    @contextmanager
    def hold(self, tenant: Tenant, amount: int = 1):
        """``amount`` of the budget for ``tenant``, for the block; Fail RESOURCE_EXHAUSTED,
        naming the limit, if it may not have it now."""
        key = tenant.label
        mine, after = self._held[key], self.used + amount
        if self.used and after > self.limit:
            self._shed(f"{self.used} {self.what} in flight, {amount} more asked ({self.setting} = {self.limit}); "
                       "retry later")
        if self.used and mine + amount > self.share and self.limit - after < self.reserved:
            self._shed(f"this tenant holds {mine} {self.what} and asks {amount} more; its share of {self.setting} = "
                       f"{self.limit} is {self.share}, and the last {self.reserved} ({self.reserve}) are kept for "
                       "tenants under their share; retry later")
        self.used += amount
        self._held[key] += amount
        try:
            yield
        finally:
            self.used -= amount
            self._held[key] -= amount
            if not self._held[key]:
                del self._held[key]

    def _shed(self, message: str) -> None:
        self.metrics.shed.labels(self.shed_label).inc()
        raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
