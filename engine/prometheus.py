"""The engine's totals as Prometheus metrics, for a process that serves an engine.

Figures are read from ``LLM.stats()`` at scrape time (no second set of counters), into a
private registry, so several engines in one process never collide:
``serve_metrics(llm, "127.0.0.1:9400")`` starts the HTTP endpoint.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily

from engine.metrics import EngineStats

_TOKENS = {"prompt": "prompt_tokens", "cached": "cached_tokens", "loaded": "loaded_tokens",
           "prefilled": "prefilled_tokens", "output": "output_tokens"}


class EngineCollector:
    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self):
        s = self._stats()
        yield CounterMetricFamily("engine_requests_finished", "requests finished", value=s.requests)
        tokens = CounterMetricFamily("engine_tokens", "tokens of finished requests by where their KV came from "
                                     "(cached: local prefix cache, loaded: the store, prefilled: computed)",
                                     labels=["kind"])
        for kind, field in _TOKENS.items():
            tokens.add_metric([kind], getattr(s, field))
        yield tokens
        yield CounterMetricFamily("engine_preemptions", "preemptions of finished requests", value=s.preemptions)
        yield CounterMetricFamily("engine_kv_load_seconds", "seconds finished requests spent loading KV",
                                  value=s.kv_load_s)
        yield CounterMetricFamily("engine_kv_save_seconds", "seconds finished requests spent gathering KV to save",
                                  value=s.kv_save_s)
        if s.connector is not None:
            for field in dataclasses.fields(s.connector):
                yield CounterMetricFamily(f"engine_connector_{field.name}", f"connector {field.name.replace('_', ' ')}",
                                          value=getattr(s.connector, field.name))


def registry_for(stats: Callable[[], EngineStats]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(stats))
    return registry


def serve_metrics(llm, addr: str):
    """Serve ``llm``'s metrics over HTTP at ``HOST:PORT`` (port 0: any free one); returns the server."""
    host, _, port = addr.rpartition(":")
    server, _ = start_http_server(int(port), host.strip("[]"), registry=registry_for(llm.stats))
    return server
