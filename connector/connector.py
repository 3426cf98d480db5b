"""Both sides of the connector over one ChunkStore, as the bundled engine holds them.

vLLM builds its connector twice, once per role and process; our engine runs the scheduler
and the model in one process, so one object holds both sides, and they talk only through
``ConnectorMetadata`` (scheduler -> worker) and ``ConnectorOutput`` (worker -> scheduler).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from connector.availability import Availability
from connector.config import ConnectorConfig
from connector.scheduler import SchedulerConnector
from connector.stats import ConnectorStats, StatsRecorder
from connector.worker import WorkerConnector
from kvstore.api import ChunkStore
from kvstore.keys import Namespace


class KVConnector:
    def __init__(self, store: ChunkStore, namespace: Namespace, block_size: int, config: ConnectorConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``namespace.chunk_tokens`` must equal ``config.chunk_tokens`` and be a multiple of
        ``block_size`` (one clear error otherwise). The caller owns ``store``; ``clock`` times
        the back-off after a store failure."""
        config.check_block_size(block_size)
        if namespace.chunk_tokens != config.chunk_tokens:
            raise ValueError(f"namespace chunk_tokens {namespace.chunk_tokens} != connector.chunk_tokens "
                             f"{config.chunk_tokens}")
        self.store, self.namespace, self.config = store, namespace, config
        self.availability = Availability(config.unavailable_backoff_s, clock)
        self._stats = StatsRecorder()
        self.scheduler = SchedulerConnector(store, namespace, block_size, config, self.availability, self._stats)
        self.worker = WorkerConnector(store, config, self.availability, self._stats)

    def register_kv_cache(self, kv_cache: torch.Tensor, max_step_tokens: int) -> None:
        """``max_step_tokens``: the most tokens one engine step computes (sizes the saves in flight)."""
        self.worker.register_kv_cache(kv_cache, self.namespace.chunk_shape, max_step_tokens)

    def stats(self) -> ConnectorStats:
        return dataclasses.replace(self._stats.snapshot(), outages=self.availability.outages)

    def close(self) -> None:
        self.worker.close()
