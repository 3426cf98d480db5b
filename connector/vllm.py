"""Our store inside real vLLM: a v1 KV connector that vLLM loads by module path.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "connector.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"daemon": {"addr": "127.0.0.1:50051"}}}'

vLLM builds this class twice, ``role=SCHEDULER`` in its EngineCore process and ``role=WORKER``
in its Worker process, so the store both halves share is our daemon (``kvstore serve``),
reached through ``kvstore.client.Client`` (shared memory on the same host). Each half wraps
the bundled engine's half of the connector unchanged: ``SchedulerConnector`` (chunk keys from
token ids, lookups, pins, load and save plans) and ``WorkerConnector`` (loads, saves, the saver
thread, failures), over vLLM's per-layer paged caches viewed through
``connector.vllm_layout``. ``kv_connector_extra_config`` is a ``ConnectorConfig`` as a dict
(``backend`` is always ``daemon``). docs/vllm.md says what is saved and loaded when.

vLLM is imported only here (and its tests), so the rest of the project runs without it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from connector.availability import Availability
from connector.backend import open_store
from connector.config import ConnectorConfig, ConnectorConfigError
from connector.metadata import ConnectorMetadata, ConnectorOutput, LoadResult
from connector.scheduler import SchedulerConnector
from connector.stats import ConnectorStats, StatsRecorder
from connector.vllm_layout import PagedLayers, blocks_view, layout_of
from connector.worker import WorkerConnector
from kvstore.config import config_from_dict
from kvstore.keys import Namespace, weights_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# vLLM prints only loggers under "vllm." in its format (connector.availability's one line per
# outage reaches stderr through Python's last-resort handler)
log = init_logger("vllm.kvstore_connector")


def connector_config(vllm_config: VllmConfig) -> ConnectorConfig:
    """``kv_connector_extra_config`` as our typed configuration; mistakes are one line."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config)
    extra.setdefault("backend", "daemon")
    config = config_from_dict(extra, ConnectorConfig)
    if config.backend != "daemon":
        raise ConnectorConfigError("connector.backend must be 'daemon' under vLLM: its scheduler and worker "
                                   "run in two processes, and only the daemon is shared between them")
    if config.role != "both" or config.load_mode == "async":
        raise ConnectorConfigError("under vLLM the connector supports role 'both' and load_mode 'sync' or "
                                   "'layerwise'")
    config.check_block_size(vllm_config.cache_config.block_size)
    return config


def model_identity(vllm_config: VllmConfig) -> str:
    """What the weights are: for a local folder our fingerprint of its contents (a fine-tune
    saved under the same name is another model), else the hub name and revision."""
    model = vllm_config.model_config.model
    if os.path.isdir(model):
        return weights_fingerprint(model)
    return f"{model}@{vllm_config.model_config.revision or 'main'}"


def vllm_namespace(vllm_config: VllmConfig, config: ConnectorConfig) -> Namespace:
    """Chunks of another model, dtype, block size or tensor-parallel rank are other keys: a
    miss, never a load. Both processes compute it from the same configuration. The store's
    layout is ours (``LKTHD``) whatever the backend's: the worker converts, and refuses a
    backend layout it does not know (``connector.vllm_layout``)."""
    model, cache, parallel = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    if cache.cache_dtype != "auto":
        raise ConnectorConfigError(f"kv cache dtype {cache.cache_dtype!r} is not supported (only 'auto')")
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise ConnectorConfigError("tensor and pipeline parallelism are not supported yet (size 1 only)")
    dtype = str(model.dtype).removeprefix("torch.")
    model_id = config.model_id or f"vllm:bs{cache.block_size}:{model_identity(vllm_config)}"
    return Namespace(model_id=model_id, num_layers=model.get_num_layers(parallel),
                     num_kv_heads=model.get_num_kv_heads(parallel), head_dim=model.get_head_size(),
                     dtype=dtype, chunk_tokens=config.chunk_tokens, tp_rank=0, tp_size=1, tenant=config.tenant)


@dataclass
class StoreMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step: our connector's plan (loads, saves)."""

    plan: ConnectorMetadata = field(default_factory=ConnectorMetadata)


@dataclass
class LoadReport(KVConnectorWorkerMetadata):
    """Worker -> scheduler, once per step: the loads that finished (their pins are released,
    a failed one's chunks are saved again once recomputed)."""

    loads: list[LoadResult] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        return LoadReport(self.loads + other.loads)


@dataclass
class StoreStats(KVConnectorStats):
    """``connector.stats.ConnectorStats`` counters of an interval, worker and scheduler halves
    summed; vLLM logs them as "KV Transfer metrics: loaded_tokens=..., saved_chunks=...". """

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        merged = dict(self.data)
        for name, value in other.data.items():
            merged[name] = merged.get(name, 0) + value
        return StoreStats(merged)

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Tracked:
    """A vLLM request as ``connector.scheduler.Request``: its live token ids, and the block
    table and computed count as of the step being planned."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.request_id = request.request_id
        self.block_table: list[int] = []
        self.num_computed = 0

    @property
    def token_ids(self):
        return self.request.all_token_ids

    @property
    def num_prompt_tokens(self) -> int:
        return self.request.num_prompt_tokens


class KVStoreConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.config = connector_config(vllm_config)
        self.namespace = vllm_namespace(vllm_config, self.config)
        self.block_size = vllm_config.cache_config.block_size
        self.store = open_store(self.config)  # a Client: connects on first use, so a dead daemon is a miss
        self.availability = Availability(self.config.unavailable_backoff_s)
        self._stats = StatsRecorder()
        self._reported = ConnectorStats()  # what get_kv_connector_stats handed over so far
        self.scheduler: SchedulerConnector | None = None
        self.worker: WorkerConnector | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = SchedulerConnector(self.store, self.namespace, self.block_size, self.config,
                                                self.availability, self._stats)
            self._tracked: dict[str, _Tracked] = {}
            if vllm_config.kv_transfer_config.kv_load_failure_policy != "recompute":
                log.warning("kvstore connector: kv_load_failure_policy is %r: a load that fails (a daemon "
                            "dying mid-load, a corrupt chunk) fails its request; set it to 'recompute'",
                            vllm_config.kv_transfer_config.kv_load_failure_policy)
        else:
            self.worker = WorkerConnector(self.store, self.config, self.availability, self._stats)
            self._layer_index: dict[str, int] = {}
            self._output = ConnectorOutput()
        log.info("kvstore connector (%s): daemon %s, %d-token chunks, model %s", role.name, self.config.daemon.addr,
                 self.config.chunk_tokens, self.namespace.model_id)

    # -- scheduler side (EngineCore process) ---------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past the ``num_computed_tokens`` vLLM holds that the store supplies. vLLM
        counts whole blocks and computes at least the last token itself, so the answer stops
        at the last whole block before it; the load still fills every hit chunk's blocks (the
        forward then rewrites the last slots with the same values)."""
        tracked = self._tracked.setdefault(request.request_id, _Tracked(request))
        tokens, _ = self.scheduler.get_num_new_matched_tokens(tracked, num_computed_tokens)
        limit = (request.num_tokens - 1) // self.block_size * self.block_size - num_computed_tokens
        return max(0, min(tokens, limit)), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            return
        tracked.block_table = list(blocks.get_block_ids()[0])
        self.scheduler.update_state_after_alloc(tracked, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, and the full chunks its forward completes. Only tokens vLLM
        already knows are counted (with async scheduling a step may run ahead of its outputs)."""
        state = scheduler_output.kv_connector_block_state
        items = []
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is not None:
                tracked.block_table = list(ids[0])
            tracked.num_computed = tracked.request.num_computed_tokens
            n = min(n, len(tracked.request.all_token_ids) - tracked.num_computed)
            if n > 0:
                items.append((tracked, n))
        return StoreMetadata(self.scheduler.build_connector_meta(items))

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if isinstance(report, LoadReport) and report.loads:
            self.scheduler.update_connector_output(ConnectorOutput(loads=report.loads))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Saves are gathered inside each step, so vLLM may free the blocks at once."""
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is not None:
            self.scheduler.request_finished(tracked)
        return False, None

    # -- worker side (Worker process) ----------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM's per-layer caches, in model order; their layout is read from their shape."""
        from vllm.model_executor.models.utils import extract_layer_index

        names = sorted(kv_caches, key=extract_layer_index)
        ns = self.namespace
        if len(names) != ns.num_layers:
            raise ConnectorConfigError(f"vLLM registered {len(names)} KV layers, the model has {ns.num_layers}")
        first = kv_caches[names[0]]
        layout = layout_of(first, self.block_size, ns.num_kv_heads, ns.head_dim)
        if str(first.dtype).removeprefix("torch.") != ns.dtype:
            raise ConnectorConfigError(f"KV cache dtype {first.dtype} is not the model's {ns.dtype}")
        mover = PagedLayers([blocks_view(kv_caches[name], layout) for name in names])
        self._layer_index = {name: i for i, name in enumerate(names)}
        max_step_tokens = self._vllm_config.scheduler_config.max_num_batched_tokens
        self.worker.register_mover(mover, first.dtype, ns.chunk_shape, max_step_tokens)
        log.info("kvstore connector: %d layers in the %s layout, block size %d", len(names), layout, self.block_size)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        self.worker.start_load_kv(meta.plan if isinstance(meta, StoreMetadata) else ConnectorMetadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer-wise loads: this layer's KV is in place (a no-op for synchronous loads)."""
        index = self._layer_index.get(layer_name)
        if index is not None:
            self.worker.wait_for_layer_load(index)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing per layer: a chunk is every layer, gathered once the forward is done
        (``wait_for_save``), so only chunks whose every layer is computed are ever put."""

    def wait_for_save(self) -> None:
        """After the forward: gather the step's new full chunks for the saver thread, and
        collect the step's load results for ``get_finished`` and the scheduler."""
        self.worker.wait_for_save()
        self._output = self.worker.get_finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads are synchronous and saves never hold blocks past their step

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of this step's loads that did not arrive (missing, corrupt, the daemon gone):
        vLLM recomputes from the first of them (``kv_load_failure_policy = "recompute"``)."""
        return self._output.failed_block_ids

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        output, self._output = self._output, ConnectorOutput()
        return LoadReport(output.loads) if output.loads else None

    # -- both sides -------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """The counters' growth since the last call (the worker's loads and saves; vLLM asks
        the scheduler half too, for its lookups and hits)."""
        now = self.stats()
        delta = {f.name: getattr(now, f.name) - getattr(self._reported, f.name) for f in dataclasses.fields(now)}
        self._reported = now
        stats = StoreStats({name: value for name, value in delta.items() if value})
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return StoreStats(dict(data or {}))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.store.close()

    def stats(self):
        """This process's counters (``connector.stats.ConnectorStats``)."""
        return dataclasses.replace(self._stats.snapshot(), outages=self.availability.outages)
