"""The connector's counters, engine-wide. Per-request figures live in the engine's
``RequestMetrics`` (tokens hit locally / loaded / computed, load and save seconds)."""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass


@dataclass
class ConnectorStats:
    lookups: int = 0  # requests looked up in the store
    hit_tokens: int = 0  # tokens claimed from the store beyond the local prefix cache
    loads: int = 0  # request loads finished
    loaded_chunks: int = 0
    loaded_tokens: int = 0  # tokens written into the paged cache from the store
    loaded_bytes: int = 0
    load_s: float = 0.0  # summed over loads (each from its start to its KV in place)
    failed_loads: int = 0  # loads where some chunk did not arrive (missing, corrupt, timed out)
    timed_out_loads: int = 0
    saved_chunks: int = 0
    saved_bytes: int = 0
    skipped_saves: int = 0  # chunks the store already held
    dropped_saves: int = 0  # not saved: the store pushed back or was unavailable
    failed_saves: int = 0  # a put raised
    gather_s: float = 0.0  # copying chunks out of the paged cache (on the step)
    put_s: float = 0.0  # handing them to the store (on the saver thread)
    outages: int = 0  # times the store failed and the connector went off for its back-off


class StatsRecorder:
    """Counters updated from the engine's thread, the loaders and the saver."""

    def __init__(self) -> None:
        self._stats = ConnectorStats()
        self._lock = threading.Lock()

    def add(self, **deltas) -> None:
        with self._lock:
            for name, value in deltas.items():
                setattr(self._stats, name, getattr(self._stats, name) + value)

    def snapshot(self) -> ConnectorStats:
        with self._lock:
            return dataclasses.replace(self._stats)
