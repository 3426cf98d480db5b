"""Prometheus metrics of one daemon, in a private registry (several daemons per process in
tests never collide).

Tier figures are read from ``Store.stats()`` at scrape time (no double bookkeeping);
per-tenant figures, per-RPC latencies and shed requests are counted by the service as it
serves. Every label takes values from a set fixed at start: tenants appear under the labels
the tenants file gives them (never their names, never anything a client sends), methods
under the service's own method names, shed requests under the limit that shed them.
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvstore.wire.stats import StoreStats

_TIER_COUNTERS = ("hits", "misses", "bytes_read", "bytes_written", "evictions", "corruptions", "errors",
                  "recodes", "lossy_hits")
_TIER_GAUGES = ("used_bytes", "capacity_bytes", "chunks")
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _StoreCollector:
    def __init__(self, stats: Callable[[], StoreStats], extra: Callable[[], dict[str, int]],
                 tenant_bytes: dict[str, Callable[[], dict[str, int]]]) -> None:
        self._stats, self._extra, self._tenant_bytes = stats, extra, tenant_bytes

    def collect(self):
        fam = GaugeMetricFamily("kvstore_tenant_bytes", "bytes a tenant holds in a tier (what its quota counts)",
                                labels=["tenant", "tier"])
        for label, used in self._tenant_bytes.items():
            for tier, nbytes in used().items():
                fam.add_metric([label, tier], nbytes)
        yield fam
        s = self._stats()
        for name in _TIER_COUNTERS:
            fam = CounterMetricFamily(f"kvstore_tier_{name}", f"per-tier {name.replace('_', ' ')}", labels=["tier"])
            for tier in s.tiers.values():
                fam.add_metric([tier.name], getattr(tier, name))
            yield fam
        for name in _TIER_GAUGES:
            fam = GaugeMetricFamily(f"kvstore_tier_{name}", f"per-tier {name.replace('_', ' ')}", labels=["tier"])
            for tier in s.tiers.values():
                fam.add_metric([tier.name], getattr(tier, name))
            yield fam
        gauges = {
            "chunks": s.chunks, "pinned_chunks": s.pinned,
            "write_behind_queue": s.write_behind_queue,
            "write_behind_pending_bytes": s.write_behind_pending_bytes,
            **self._extra(),
        }
        for name, value in gauges.items():
            yield GaugeMetricFamily(f"kvstore_{name}", name.replace("_", " "), value=value)
        yield CounterMetricFamily("kvstore_write_behind_dropped", "copies to replica tiers that failed",
                                  value=s.write_behind_dropped)
        yield CounterMetricFamily("kvstore_recode_failures", "placement re-encodes that failed or did not shrink",
                                  value=s.recode_failures)


class DaemonMetrics:
    def __init__(self, stats: Callable[[], StoreStats], extra: Callable[[], dict[str, int]],
                 tenant_bytes: dict[str, Callable[[], dict[str, int]]] | None = None) -> None:
        """``tenant_bytes``: per tenant label, its bytes per tier."""
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(stats, extra, tenant_bytes or {}))
        labels = ["tenant"]
        self.hits = Counter("kvstore_tenant_hits", "chunks served", labels, registry=self.registry)
        self.misses = Counter("kvstore_tenant_misses", "chunks asked for and absent", labels, registry=self.registry)
        self.bytes_read = Counter("kvstore_tenant_bytes_read", "bytes served", labels, registry=self.registry)
        self.bytes_written = Counter("kvstore_tenant_bytes_written", "bytes stored", labels, registry=self.registry)
        self.scheduler_waits = Counter("kvstore_tenant_scheduler_waits", "pieces of a tenant's work that waited "
                                       "for its turn, its use over its share", labels, registry=self.registry)
        self.shed = Counter("kvstore_shed_requests", "requests refused at once with RESOURCE_EXHAUSTED",
                            ["limit"], registry=self.registry)
        self.rpc_seconds = Histogram("kvstore_rpc_seconds", "RPC latency", ["method"],
                                     buckets=LATENCY_BUCKETS, registry=self.registry)
        self.rpc_errors = Counter("kvstore_rpc_errors", "RPCs that ended in an error", ["method", "code"],
                                  registry=self.registry)
        self._server = None

    def hit(self, tenant_label: str, nbytes: int) -> None:
        self.hits.labels(tenant_label).inc()
        self.bytes_read.labels(tenant_label).inc(nbytes)

    def miss(self, tenant_label: str) -> None:
        self.misses.labels(tenant_label).inc()

    def wrote(self, tenant_label: str, nbytes: int) -> None:
        self.bytes_written.labels(tenant_label).inc(nbytes)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint in a background thread; returns the bound port."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
