"""Per-tenant admission: requests being served at once and the chunk bytes they hold.

A tenant over either limit has its next request refused at once with RESOURCE_EXHAUSTED
(counted as shed), instead of queueing behind everyone's work in the executor: one tenant's
flood slows that tenant, not the daemon. Used only from the event loop thread.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import grpc

from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.daemon.metrics import DaemonMetrics


class Admission:
    def __init__(self, max_requests: int, max_bytes: int, metrics: DaemonMetrics) -> None:
        self.max_requests, self.max_bytes, self.metrics = max_requests, max_bytes, metrics
        self._requests: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()

    @contextmanager
    def admit(self, tenant: Tenant, nbytes: int = 0):
        """Hold one request slot and ``nbytes`` of ``tenant``'s in-flight budget for the block."""
        key = tenant.label
        if self._requests[key] >= self.max_requests:
            self._shed("requests_per_tenant", f"{self._requests[key]} requests of this tenant in flight "
                       f"(limits.max_requests_per_tenant = {self.max_requests}); retry later")
        with self.add_bytes(tenant, nbytes):
            self._requests[key] += 1
            try:
                yield
            finally:
                self._requests[key] -= 1

    @contextmanager
    def add_bytes(self, tenant: Tenant, nbytes: int):
        """Hold ``nbytes`` more of ``tenant``'s in-flight budget for the block (for a request
        already admitted that learns its size later: a Put stream's header). A request alone
        may exceed the limit by itself (one chunk is at most ``max_chunk_bytes``)."""
        key = tenant.label
        if self._bytes[key] and self._bytes[key] + nbytes > self.max_bytes:
            self._shed("bytes_per_tenant", f"{self._bytes[key]} bytes of this tenant in flight, {nbytes} more asked "
                       f"(limits.max_bytes_in_flight_per_tenant = {self.max_bytes}); retry later")
        self._bytes[key] += nbytes
        try:
            yield
        finally:
            self._bytes[key] -= nbytes

    def in_flight(self, tenant: Tenant) -> tuple[int, int]:
        return self._requests[tenant.label], self._bytes[tenant.label]

    def _shed(self, limit: str, message: str) -> None:
        self.metrics.shed.labels(limit).inc()
        raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, message)
