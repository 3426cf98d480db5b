"""``KVConnector``: the one object through which an engine reaches the store.

vLLM builds its connector twice, once per role and process, and its engine knows only
``KVConnectorBase_V1``; our engine runs the scheduler and the model in one process, so one
object holds both sides, and the engine calls only the methods below (its scheduler the
scheduler side's, its model runner the worker side's, its agent sessions the session
verbs). The two sides talk only through ``ConnectorMetadata`` (scheduler -> worker) and
``ConnectorOutput`` (worker -> scheduler).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from connector.availability import Availability
from connector.config import ConnectorConfig
from connector.metadata import ConnectorMetadata, ConnectorOutput
from connector.roles import PromisedChunks, TransferParams
from connector.scheduler import Request, SchedulerConnector
from connector.sessions import SESSION_HOLDER, PausedSessions, SessionPins
from connector.stats import ConnectorStats, StatsRecorder
from connector.worker import WorkerConnector
from kvstore.api import ChunkStore
from kvstore.keys import Namespace, chunk_keys


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
        self._sessions = PausedSessions(store, namespace, self.scheduler.blocks_per_chunk, self.scheduler.pins,
                                        self.scheduler.tails, self.worker.save_tail, self.availability)

    # -- scheduler side (the engine's scheduler calls these) -----------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        """(tokens past the ``num_local`` locally cached ones the store can supply, whether they
        arrive asynchronously). The chunks stay pinned until ``update_state_after_alloc``."""
        return self.scheduler.get_num_new_matched_tokens(request, num_local)

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """The engine allocated blocks for every token of ``request``: plan its load."""
        self.scheduler.update_state_after_alloc(request, num_external_tokens)

    def build_connector_meta(self, items: Sequence[tuple[Request, int]]) -> ConnectorMetadata:
        """This step's plan: the loads planned since the last step, and the full chunks the
        scheduled ``(request, new tokens)`` complete (to save)."""
        return self.scheduler.build_connector_meta(items)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """What the worker side finished: loads release their pins, a failed one is saved again."""
        self.scheduler.update_connector_output(output)

    def request_finished(self, request: Request) -> None:
        """Before the engine frees ``request``'s blocks: forget it, release its pins."""
        self.scheduler.request_finished(request)

    def on_preempt(self, request: Request) -> None:
        """``request`` loses its blocks; on resume it is looked up again."""
        self.scheduler.on_preempt(request)

    def check_idle(self) -> None:
        """Raise AssertionError unless this side is idle, as it must be when the engine holds no
        request: no request tracked, no pin held but paused sessions'."""
        assert self.scheduler.num_tracked == 0, "the connector still tracks finished requests"
        assert all(h.startswith(SESSION_HOLDER) for h in self.scheduler.pins.holders()), \
            "the connector still holds pins"

    # -- worker side (the engine's model runner calls these, in this order per step) ------------

    def register_kv_cache(self, kv_cache: torch.Tensor, max_step_tokens: int) -> None:
        """The paged cache, once. ``max_step_tokens``: the most tokens one engine step computes
        (sizes the saves in flight)."""
        self.worker.register_kv_cache(kv_cache, self.namespace.chunk_shape, max_step_tokens)

    def start_load_kv(self, plan: ConnectorMetadata) -> None:
        """Start the plan's loads and take note of its saves, before the forward."""
        self.worker.start_load_kv(plan)

    def wait_for_layer_load(self, layer: int) -> None:
        """Before layer ``layer`` computes (``load_mode = "layerwise"``): its KV is in place."""
        self.worker.wait_for_layer_load(layer)

    def set_attention_mass(self, mass: dict) -> None:
        """A producer ranking tokens by attention: the prompts' observed attention, per request."""
        self.worker.set_attention_mass(mass)

    def wait_for_save(self) -> None:
        """After the forward: gather the chunks it completed and hand them to the saver."""
        self.worker.wait_for_save()

    def get_finished(self) -> ConnectorOutput:
        """The loads settled since the last call and this step's save times (for the scheduler side)."""
        return self.worker.get_finished()

    def wait_for_loads(self, timeout_s: float) -> None:
        """A step without a forward: wait, at most ``timeout_s``, until a load in flight settles."""
        self.worker.wait_for_loads(timeout_s)

    def flush_saves(self, timeout_s: float = 60.0) -> bool:
        """Wait until every save handed over so far is in the store; False if ``timeout_s`` passed first."""
        return self.worker.flush_saves(timeout_s)

    def staging_out(self) -> int:
        """Staging buffers not given back (0 when nothing is in flight): for checks after faults."""
        return self.worker.load_staging.outstanding + self.worker.save_staging.outstanding

    # -- agent sessions (the engine's session manager calls these) ------------------------------

    def pause_session(self, session: str, token_ids: Sequence[int], ttl_s: float,
                      block_table: Sequence[int] | None = None) -> SessionPins:
        """``session`` pauses with KV for ``token_ids``: pin its chunks (and its tail) for
        ``ttl_s`` (extends, never shortens). With ``block_table``, its device blocks, first save
        its tail from them (the blocks are about to be released). Pins that find a chunk still
        in the saver's queue are ``missing``: pause again shortly."""
        return self._sessions.pause(session, token_ids, ttl_s, block_table)

    def resume_session(self, session: str, token_ids: Sequence[int]) -> int:
        """``session``'s next turn is coming: bring its chunks (and its tail) up to the store's
        fastest tier; returns how many prefetches started. Pin them first (``pause_session``
        with a lease past the turn's arrival), so they stay there."""
        return self._sessions.resume(session, token_ids)

    def unpin_session(self, session: str) -> None:
        """Release ``session``'s pins (its next turn holds its KV now, or it is over the pin
        budget); its tail stays for the next turn's lookup."""
        self._sessions.unpin(session)

    def end_session(self, session: str) -> None:
        """``session`` is over: release its pins and delete its tail."""
        self._sessions.end(session)

    # -- prefill-decode disaggregation ---------------------------------------------------------

    def transfer_params(self, request_id: str, prompt: Sequence[int], first_token: int) -> TransferParams:
        """A producer's promise for a prompt whose saves are flushed: the leading chunks the
        store holds durably (none if the store went away after the puts)."""
        keys = chunk_keys(prompt, self.namespace)
        try:
            n = self.worker.saver.promised(keys)
        except (ValueError, TypeError):
            raise
        except Exception:
            n = 0
        return TransferParams(request_id, [k.id.hex() for k in keys[:n]], n * self.namespace.chunk_tokens,
                              first_token, self.config.transfer.codec)

    def promised_chunks(self, prompt: Sequence[int], transfer: TransferParams | None) -> PromisedChunks:
        """A consumer's bounded wait (``transfer.wait_s``) for the chunks a producer promised for ``prompt``."""
        return PromisedChunks(self.store, chunk_keys(prompt, self.namespace), transfer, self.config.transfer.wait_s)

    # -- the whole connector ----------------------------------------------------------------------

    def stats(self) -> ConnectorStats:
        return dataclasses.replace(self._stats.snapshot(), outages=self.availability.outages)

    def close(self) -> None:
        """Give up loads in flight, put the queued saves, stop the threads (the store stays open)."""
        self.worker.close()
