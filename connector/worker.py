"""The connector's worker side: it owns the tensors. It registers the paged KV cache, runs
the loads the scheduler side planned (in the step, between steps, or layer by layer), saves
the chunks each forward completed, and reports finished loads and the blocks that failed.

Per step the runner calls, in order: ``start_load_kv(meta)``, the forward (calling
``wait_for_layer_load(i)`` before layer ``i`` when loads are layer-wise), ``wait_for_save()``,
then ``get_finished()``. With nothing to run but loads in flight the engine calls
``wait_for_loads`` instead of a forward.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from connector.availability import Availability
from connector.config import ConnectorConfig
from connector.loads import LoadTask
from connector.metadata import ChunkSave, ConnectorMetadata, ConnectorOutput, LoadResult
from connector.roles import ProducerSaver
from connector.saver import Saver
from connector.staging import StagingPool
from connector.stats import StatsRecorder
from connector.transfer import ChunkMover
from kvstore.api import ChunkStore, LendsChunks
from kvstore.keys import ChunkKey

log = logging.getLogger(__name__)


class WorkerConnector:
    def __init__(self, store: ChunkStore, config: ConnectorConfig, availability: Availability,
                 stats: StatsRecorder) -> None:
        self.store, self.config, self.availability, self.stats = store, config, availability, stats
        self.mode = config.load_mode
        self._cond = threading.Condition()  # guards every load's state; any progress notifies
        self._loaders = ThreadPoolExecutor(config.load_workers, thread_name_prefix="connector-load")
        self._layer_scatter = ThreadPoolExecutor(1, thread_name_prefix="connector-layers")
        self._inflight: list[LoadTask] = []  # asynchronous loads not yet reported
        self._step_tasks: list[LoadTask] = []  # this step's synchronous or layer-wise loads
        self._layers_ready: list[threading.Event] = []
        self._layer_job: Future | None = None
        self._finished: list[LoadResult] = []
        self._save_seconds: dict[str, float] = {}
        self._meta = ConnectorMetadata()
        self._attention: dict = {}
        self._told_dropped = False
        self.mover: ChunkMover | None = None
        self.lends_to_gpu = False  # the store's lent chunks are a DMA source for the GPU cache

    def register_kv_cache(self, kv_cache: torch.Tensor, chunk_shape: tuple[int, ...], max_step_tokens: int) -> None:
        """The engine's ``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` cache, once."""
        self.register_mover(ChunkMover(kv_cache), kv_cache.dtype, chunk_shape, max_step_tokens)

    def register_mover(self, mover: ChunkMover, dtype: torch.dtype, chunk_shape: tuple[int, ...],
                       max_step_tokens: int) -> None:
        """The paged cache behind ``mover`` (ChunkMover's interface; vLLM's per-layer caches:
        ``connector.vllm_layout.PagedLayers``), once. ``max_step_tokens``: the most tokens one
        forward computes; by default the saves waiting for their put may hold two such steps'
        chunks (and tails), so a prompt is never cut for want of a buffer while the store keeps up."""
        self.mover = mover
        pin = mover.cuda
        self.lends_to_gpu = pin and isinstance(self.store, LendsChunks) and self.store.prepare_lending(mover.device)
        in_flight = self.config.load_workers * self.config.chunks_per_read  # buffers one direct load uses
        self.load_staging = StagingPool(chunk_shape, dtype, pin, keep=self.config.staging_chunks,
                                        prefault=in_flight)
        step_chunks = -(-max_step_tokens // chunk_shape[2]) + 2  # + a chunk begun last step, + a tail
        self.save_staging = StagingPool(chunk_shape, dtype, pin, keep=self.config.staging_chunks,
                                        limit=self.config.max_pending_saves or 2 * step_chunks)
        if self.config.role == "producer":
            self.saver = ProducerSaver(self.store, self.save_staging, self.availability, self.stats,
                                       self.config.transfer)
        else:
            self.saver = Saver(self.store, self.save_staging, self.availability, self.stats)

    # -- loads ------------------------------------------------------------------------------

    def _task(self, request) -> LoadTask:
        return LoadTask(request, self.store, self.load_staging, self.mover, self.availability, self._cond,
                        self.config.chunks_per_read, self.config.load_timeout_s, layerwise=self.mode == "layerwise",
                        lends_to_gpu=self.lends_to_gpu)

    def start_load_kv(self, meta: ConnectorMetadata) -> None:
        """Start this step's loads; synchronous ones are in place when this returns."""
        self._meta = meta
        tasks = [self._task(r) for r in meta.loads]
        for task in tasks:
            task.submit(self._loaders, here=self.mode == "sync")
        if self.mode == "async":
            self._inflight += tasks
            return
        self._step_tasks = tasks
        if self.mode == "sync":
            self._settle(tasks)
            self._step_tasks = []

    def _settle(self, tasks: list[LoadTask]) -> None:
        """Wait for each load and report it. A load that raises (a scatter failed) fails the
        step, but only once every other load of the step is settled too: their reads still in
        flight are abandoned, so none writes the paged cache after the step returned."""
        error = None
        with self._cond:
            for task in tasks:
                if error is None:
                    task.wait()
                try:
                    result = task.finish()
                except BaseException as exc:
                    error = error or exc
                    continue
                if error is None:
                    self._report(result)
        if error is not None:
            self._step_tasks = []  # settled: close() has nothing of them to finish (or raise again)
            raise error

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer ``layer`` computes: its KV of this step's layer-wise loads is in place."""
        if not self._step_tasks:
            return
        if layer == 0:
            self._start_layer_scatter()
        self._layers_ready[layer].wait()

    def _start_layer_scatter(self) -> None:
        """Every read is in (or given up): scatter layer by layer on a thread of its own."""
        tasks = self._step_tasks
        try:
            self._settle(tasks)
        except BaseException:
            for task in tasks:  # nothing of them is scattered: their staged buffers go back
                task.release_staged()
            raise
        staged = [(task, task.staged()) for task in tasks]
        self._layers_ready = [threading.Event() for _ in range(self.mover.num_layers)]

        def scatter_layers() -> None:
            try:
                for layer, ready in enumerate(self._layers_ready):
                    for _, chunks in staged:
                        for buf, chunk in chunks:
                            self.mover.scatter_layer(buf, chunk, layer)
                    ready.set()
            finally:
                for task, _ in staged:
                    task.release_staged()
                for ready in self._layers_ready:
                    ready.set()  # a failed scatter must not hang the forward: the job re-raises below

        self._layer_job = self._layer_scatter.submit(scatter_layers)

    def _finish_layerwise(self) -> None:
        if self._layer_job is not None:
            job, self._layer_job = self._layer_job, None
            job.result()
        self._step_tasks = []

    def _report(self, result: LoadResult) -> None:
        self._finished.append(result)
        self.stats.add(loads=1, loaded_chunks=result.loaded_chunks, loaded_tokens=result.loaded_tokens,
                       loaded_bytes=result.bytes, load_s=result.seconds, failed_loads=int(not result.ok),
                       timed_out_loads=int(result.timed_out))

    def wait_for_loads(self, timeout_s: float) -> None:
        """Nothing else to run: wait until an asynchronous load is settled or past its deadline."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._inflight and not any(t.known() or t.expired() for t in self._inflight):
                remaining = min(deadline, min(t.deadline for t in self._inflight)) - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    # -- saves ------------------------------------------------------------------------------

    def set_attention_mass(self, mass: dict) -> None:
        """This step's observed attention, request id -> ``[layers, tokens]`` (a producer ranks
        the tokens of the chunks it saves after this forward by it)."""
        self._attention = mass

    def wait_for_save(self) -> None:
        """After the forward: gather the step's newly completed chunks and hand them to the
        saver. A request whose load failed this step computed on bad KV: none of its chunks
        are saved (the scheduler side plans them again once recomputed)."""
        if self.saver.error is not None:
            raise self.saver.error
        # A layer scatter that failed left layers of this step's loads unwritten, and the
        # forward computed over them: it raises here, before any chunk of the step is saved.
        self._finish_layerwise()
        failed = {r.request_id for r in self._finished if not r.ok}
        for request in self._meta.saves:
            if request.request_id in failed:
                continue
            if not self.availability.available():
                self.stats.add(dropped_saves=len(request.chunks))
                continue
            started = time.perf_counter()
            items = []
            for i, save in enumerate(request.chunks):
                if not self.saver.claim(save):
                    continue  # another request is saving the same chunk now
                buf = self.save_staging.take()
                if buf is None:  # the saver is behind: the store is pushing back
                    self.saver.unclaim(save)
                    self._dropped(len(request.chunks) - i)
                    break
                items.append((save, buf))
                try:
                    self.mover.gather(save.block_ids, buf)
                except BaseException:  # (a device out of memory) raised, with nothing claimed or taken left behind
                    for claimed, taken in items:
                        self.saver.unclaim(claimed)
                        self.save_staging.give(taken)
                    raise
                mass = self._attention.get(request.request_id)
                if mass is not None:
                    c = buf.shape[2]
                    self.saver.rank(save, mass[:, save.index * c:(save.index + 1) * c])
            if items:
                self.saver.submit(items)
            elapsed = time.perf_counter() - started
            self._save_seconds[request.request_id] = elapsed
            self.stats.add(gather_s=elapsed)

    def save_tail(self, key: ChunkKey, block_ids: list[int]) -> bool:
        """Between steps: a paused session's tail (fewer blocks than a chunk, see
        connector/sessions.py) into the store, zero-padded to the chunk's shape. False when
        the store is off or the saver is behind (the tail is then recomputed on resume)."""
        save = ChunkSave(key, None, tuple(block_ids))
        if not self.availability.available() or not self.saver.claim(save):
            return False
        buf = self.save_staging.take()
        if buf is None:
            self.saver.unclaim(save)
            self._dropped(1)
            return False
        try:
            self.mover.gather(block_ids, buf)
        except BaseException:  # (a device out of memory) raised, with nothing claimed or taken left behind
            self.saver.unclaim(save)
            self.save_staging.give(buf)
            raise
        self.saver.submit([(save, buf)])
        return True

    def _dropped(self, n: int) -> None:
        """``n`` saves found no buffer: counted always, said once (a future miss, never a wrong load)."""
        self.stats.add(dropped_saves=n)
        if not self._told_dropped:
            self._told_dropped = True
            log.warning("connector: %d saves dropped, %d chunk buffers all waiting for their put (the store is "
                        "slower than prefill); further drops are only counted (stats: dropped_saves)",
                        n, self.save_staging.limit)

    # -- reports ----------------------------------------------------------------------------

    def get_finished(self) -> ConnectorOutput:
        """This step's load results (asynchronous loads once settled or expired) and save times."""
        self._finish_layerwise()
        with self._cond:
            for task in [t for t in self._inflight if t.known() or t.expired()]:
                self._inflight.remove(task)
                self._report(task.finish())
        out = ConnectorOutput(loads=self._finished, save_seconds=self._save_seconds)
        self._finished, self._save_seconds, self._meta, self._attention = [], {}, ConnectorMetadata(), {}
        return out

    def flush_saves(self, timeout_s: float = 60.0) -> bool:
        """Wait until every save handed over so far is in the store (tests, benchmarks, shutdown)."""
        ok = self.saver.flush(timeout_s)
        if self.saver.error is not None:
            raise self.saver.error
        return ok

    def close(self) -> None:
        """Give up loads in flight, finish queued saves, stop the threads."""
        with self._cond:
            for task in self._inflight + self._step_tasks:
                try:
                    task.finish()
                except BaseException:  # a load's failure (its step raised it, or the engine is closing): close anyway
                    pass
        self._inflight, self._step_tasks = [], []
        self._finish_layerwise()
        self.saver.close()
        self._loaders.shutdown(wait=False, cancel_futures=True)
        self._layer_scatter.shutdown(wait=True)
