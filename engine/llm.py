"""The engine's front door: ``LLM(model_path).generate(prompts, SamplingParams(...))``.

One ``step()`` = schedule -> run the model -> sample -> update sequences. ``generate`` runs
steps until its requests finish; ``stream`` yields each new token as it is produced.
A bad request raises ValueError at ``add_request`` and leaves the engine serving the rest.

With ``EngineConfig.connector`` set, the engine loads KV it has not got from a store and
saves what it computes (docs/connector.md): the store named by the configuration, or the
``kv_store`` given (the caller keeps ownership of that one).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from connector import KVConnector, open_store, resolve_backend
from engine.block_manager import BlockManager
from engine import threads
from engine.config import EngineConfig
from engine.metrics import EngineStats, RequestMetrics
from engine.models.loader import load_model, model_fingerprint, resolve_model_path
from engine.policies import make_policy
from engine.resume_priority import ResumePriority
from engine.runner import ModelRunner
from engine.sampling import SamplingParams, sample
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.sessions import SessionManager
from engine.tokenizer import Tokenizer
from kvstore.api import ChunkStore
from kvstore.keys import Namespace

Prompt = str | list[int]
log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """A request's state after a step; ``new_token_ids``/``new_text`` are what this step added."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics


def _stable_text(text: str, stops: list[str]) -> str:
    """``text`` less what the next tokens may still change: trailing U+FFFD (a character split
    over byte tokens decodes so until its last byte arrives) and the longest suffix that is the
    start of a stop string (which would cut it off)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), hold, -1):
            if text.startswith(stop[:k], end - k):
                hold = k
                break
    return text[:end - hold]


class LLM:
    def __init__(self, model_path: str | Path, config: EngineConfig | None = None, kv_store: ChunkStore | None = None,
                 **overrides):
        self.config = config or EngineConfig(**overrides)
        chosen = threads.apply(self.config.threads)
        path = resolve_model_path(model_path)
        self.model_id = model_fingerprint(path)
        self.model = load_model(path, dtype=self.config.dtype, device=self.config.device, fingerprint=self.model_id)
        self.model_config = self.model.config
        self.kv_store, self._owns_store = kv_store, False
        self._backend: str | None = None  # the connector backend this engine opened, if it opened one
        self.tokenizer = Tokenizer.from_path(path)
        eos = set(self.model_config.eos_token_ids)
        eos_from_tokenizer = self.tokenizer.token_id(self.tokenizer.eos_token)
        if eos_from_tokenizer is not None:
            eos.add(eos_from_tokenizer)
        self.eos_token_ids = eos
        self._start()
        log.info("%s", chosen)  # once the engine could start: a configuration error is the only line

    def _start(self) -> None:
        """A fresh KV cache, block manager and scheduler for ``self.config``."""
        cfg = self.config
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings)
        watermark = int(cfg.admission_watermark * cfg.num_blocks)
        self.block_manager = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, watermark)
        self.runner = ModelRunner(self.model, cfg.num_blocks, cfg.block_size, cfg.device)
        self.connector = None
        if cfg.connector is not None:
            if self.kv_store is None:
                self._backend = resolve_backend(cfg.connector)
                self.kv_store, self._owns_store = open_store(cfg.connector, self._backend), True
            mc = self.model_config
            ns = Namespace(cfg.connector.model_id or self.model_id, mc.num_layers, mc.num_kv_heads, mc.head_dim,
                           mc.dtype, cfg.connector.chunk_tokens, tenant=cfg.connector.tenant)
            self.connector = KVConnector(self.kv_store, ns, cfg.block_size, cfg.connector)
            self.connector.register_kv_cache(self.runner.kv_cache, cfg.max_num_batched_tokens)
            t = cfg.connector.transfer
            if cfg.connector.role == "producer" and t.ranks_by_attention:
                self.runner.observe_window = t.observe_tokens
        agents = cfg.agents
        policy = ResumePriority(make_policy(cfg.policy), lambda seq: self.sessions.staged(seq),
                                agents.resume_priority_bound)
        self.scheduler = Scheduler(self.block_manager, policy, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   self.connector,
                                   int(agents.critical_reserve_fraction * cfg.num_blocks))
        mc = self.model_config
        kv_bytes_per_token = mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * self.runner.kv_cache.element_size()
        self.sessions = SessionManager(agents, self.block_manager, self.scheduler, self.connector, kv_bytes_per_token,
                                       self._pin_budget())
        self.totals = EngineStats()

    def _pin_budget(self) -> int | None:
        """Paused sessions' pinned bytes: as configured, else half an in-process store's host RAM."""
        cfg = self.config
        if cfg.agents.pin_budget_bytes is not None or cfg.connector is None:
            return cfg.agents.pin_budget_bytes
        if self._owns_store and self._backend == "store":
            return cfg.connector.store_host_bytes // 2
        return None

    def with_config(self, kv_store: ChunkStore | None = None, **overrides) -> "LLM":
        """Another engine sharing this one's weights and tokenizer, with its own KV cache, queue
        and connector; its store is ``kv_store`` if given, else this engine's (which stays
        this engine's to close). Close it when done."""
        other = copy.copy(self)
        other.config = dataclasses.replace(self.config, **overrides)
        if other.config.dtype not in (None, self.model_config.dtype) or other.config.device != self.config.device:
            raise ValueError("with_config cannot change dtype or device (the weights are shared)")
        if other.config.threads != self.config.threads:
            raise ValueError("with_config cannot change threads (torch's threads are the process's)")
        other.kv_store = kv_store or self.kv_store
        other._owns_store = False
        other._start()
        return other

    def reset_prefix_cache(self) -> None:
        """Forget the local prefix cache (between runs of a benchmark or a test); the engine must be idle."""
        if self.has_unfinished():
            raise RuntimeError("reset_prefix_cache while requests are queued or running")
        self.block_manager.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Totals over the requests finished so far, and the connector's counters."""
        return dataclasses.replace(self.totals, connector=self.connector.stats() if self.connector else None)

    def flush_saves(self, timeout_s: float = 60.0) -> bool:
        """Wait until every chunk saved so far is in the store; False if ``timeout_s`` passed first."""
        return self.connector is None or self.connector.flush_saves(timeout_s)

    def pause(self, session: str, expected_s: float | None = None, tool: str = "") -> bool:
        """Advisory: ``session``'s agent waits on a tool for about ``expected_s`` seconds (None:
        predicted from past stalls). Its KV is kept on the device, offloaded to the store
        (every chunk pinned for ``clamp(4 x expected, 60 s, 1 h)``, the device blocks freed) or
        dropped, by the cost model (docs/agents.md). False (a no-op) for an unknown session."""
        return self.sessions.pause(session, expected_s, tool)

    def resume_soon(self, session: str, eta_s: float) -> bool:
        """Advisory: ``session``'s next turn comes in about ``eta_s`` seconds; its chunks are
        prefetched into host RAM and its turn is admitted ahead of cold requests (bounded).
        False (a no-op) for an unknown session or one whose turn is already queued."""
        return self.sessions.resume_soon(session, eta_s)

    def end_session(self, session: str) -> bool:
        """``session`` is over: its device blocks and pins are released now."""
        return self.sessions.end(session)

    def close(self) -> None:
        """Stop the connector (queued saves are put first) and close the store this engine opened."""
        self.sessions.close()
        if self.connector is not None:
            self.connector.close()
        if self._owns_store:
            self.kv_store.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def add_request(self, prompt: Prompt, params: SamplingParams, request_id: str = "",
                    arrival_time: float | None = None, session: str = "", critical: bool = False) -> Sequence:
        """Validate and queue one request; raises ValueError naming the problem. ``session``
        names the agent session it is a turn of (see ``pause``); ``critical`` lets it use the
        memory reserved for critical agents."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        known = self.sessions.sessions.get(session) if session else None
        self._validate(token_ids, params, critical or bool(known and known.critical))  # critical is sticky per session
        queued = self.scheduler.waiting + self.scheduler.running + self.scheduler.loading
        if request_id and any(s.request_id == request_id for s in queued):
            raise ValueError(f"request id {request_id!r} is already in use")  # the connector tracks requests by id
        now = time.perf_counter() if arrival_time is None else arrival_time
        seq = Sequence(token_ids, params, now, request_id=request_id, session=session, critical=critical)
        if session:
            self.sessions.on_add(seq, now)
        self.scheduler.add(seq)
        return seq

    def _validate(self, token_ids: list[int], params: SamplingParams, critical: bool = False) -> None:
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt has token ids outside the vocabulary [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, the context holds {self.max_model_len} (prompt too long)"
            )
        bm = self.block_manager
        if bm.blocks_needed(len(token_ids)) > self.config.num_blocks - bm.watermark_blocks:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the KV cache admits")
        reserved = 0 if critical else self.scheduler.critical_reserve_blocks
        if bm.blocks_needed(len(token_ids)) > self.config.num_blocks - bm.watermark_blocks - reserved:
            raise ValueError(f"prompt has {len(token_ids)} tokens, more than the KV cache admits beside the "
                             f"{reserved} blocks reserved for critical agents")
        capacity = self.config.num_blocks * self.config.block_size
        needed = min(len(token_ids) + params.max_tokens, self.max_model_len)
        if needed > capacity:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) needs {needed} "
                f"KV slots, the cache holds {capacity}"
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns an output for every request that got a token."""
        now = time.perf_counter()
        self.sessions.before_step(now)
        batch = self.scheduler.schedule(now)
        plan = self.connector.build_connector_meta(batch.items) if self.connector else None
        if not batch.items:
            if self.scheduler.loading:  # nothing to compute until some KV arrives
                self._wait_for_kv(plan)
                return []
            if self.scheduler.waiting and not self.scheduler.running and not batch.preempted:
                # (a step that preempted its last running request admits nothing; the next one
                # starts with nothing running, which lets sessions give up their hard holds)
                raise RuntimeError("waiting requests cannot be admitted into an empty KV cache")
            return []
        voided: set[Sequence] = set()
        if plan is None:
            results = self.runner.run(batch)
        else:
            results, output = self.runner.run_with_connector(batch, self.connector, plan)
            voided = self.scheduler.on_connector_output(output)
        self.sessions.observe_forward(batch.num_tokens, time.perf_counter() - now)
        for seq, n in batch.items:
            if seq in voided:
                continue
            if n > 1 or seq.num_computed < seq.num_prompt_tokens:
                seq.metrics.num_prefilled_tokens += n
            seq.num_computed += n
            self.block_manager.register_full_blocks(seq)
        done = time.perf_counter()
        return [self._append_token(seq, sample(logits, seq.params, seq.generator), done)
                for seq, logits in results if seq not in voided]

    def _wait_for_kv(self, plan) -> None:
        """A step without a forward: start the planned loads, wait (bounded) until one settles."""
        self.connector.start_load_kv(plan)
        self.connector.wait_for_loads(self.config.connector.load_timeout_s)
        self.scheduler.on_connector_output(self.connector.get_finished())

    def _append_token(self, seq: Sequence, token: int, now: float) -> RequestOutput:
        metrics = seq.metrics
        metrics.first_token_time = metrics.first_token_time or now
        seq.token_ids.append(token)
        metrics.num_output_tokens = len(seq.output_token_ids)
        reason = None
        if token in self.eos_token_ids and not seq.params.ignore_eos:
            reason = "stop"
        text = self.tokenizer.decode(seq.output_token_ids)
        for stop in seq.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text, reason = text[:cut], "stop"
        seq.text = text
        if reason is None and (metrics.num_output_tokens >= seq.params.max_tokens or len(seq) >= self.max_model_len):
            reason = "length"
        # Stream only text no later token can change: a trailing character whose bytes are not
        # all in yet, or a suffix that may begin a stop string, waits (until the request ends).
        stable = text if reason is not None else _stable_text(text, seq.params.stop)
        new_text = stable[len(seq.streamed_text):]
        if new_text:
            seq.streamed_text = stable
        if reason is not None:
            metrics.finish_time = now
            if seq.session:
                self.sessions.on_finish(seq, now)
            self.scheduler.finish(seq, reason)
            self.totals.add(metrics)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, seq.text, [token],
                             new_text, seq.is_finished, seq.finish_reason, metrics)

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output every time it gains a token, until all finish."""
        yield from self.stream_seqs(self._add_all(prompts, params))

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion (batched together); outputs in prompt order."""
        last = {}
        seqs = self._add_all(prompts, params)
        for out in self.stream_seqs(seqs):
            last[out.request_id] = out
        return [last[s.request_id] for s in seqs]

    def stream_seqs(self, seqs: list[Sequence]) -> Iterator[RequestOutput]:
        """Step the engine (serving every queued request) until ``seqs`` finish; yield theirs."""
        ids = {s.request_id for s in seqs}
        while any(not s.is_finished for s in seqs):
            for out in self.step():
                if out.request_id in ids:
                    yield out

    def _add_all(self, prompts, params) -> list[Sequence]:
        """Validate every prompt before queueing any, so a bad one leaves no half-added batch."""
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise ValueError("no prompts given")
        encoded = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        for i, ids in enumerate(encoded):
            try:
                self._validate(ids, params)
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        return [self.add_request(ids, params) for ids in encoded]
