"""Per-request timing and KV accounting, in seconds and tokens, and the engine's totals."""

from __future__ import annotations

from dataclasses import dataclass

from connector import ConnectorStats


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (first admission)
    num_loaded_tokens: int = 0  # tokens whose KV was loaded from the store (resumes included)
    num_prefilled_tokens: int = 0  # tokens run through prefill, recomputation after preemption included
    num_preemptions: int = 0
    kv_load_s: float = 0.0  # this request's loads, each from its start until its KV was in place
    kv_save_s: float = 0.0  # copying its new chunks out of the paged cache (their puts run in the background)

    @property
    def ttft(self) -> float | None:
        """Time to first token, from arrival."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.finish_time is None or self.first_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)


@dataclass
class EngineStats:
    """Totals over finished requests; ``connector`` holds the connector's own counters."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # hit in the local prefix cache
    loaded_tokens: int = 0  # loaded from the store
    prefilled_tokens: int = 0  # computed by prefill (recomputation included)
    output_tokens: int = 0
    preemptions: int = 0
    kv_load_s: float = 0.0
    kv_save_s: float = 0.0
    connector: ConnectorStats | None = None

    def add(self, m: RequestMetrics) -> None:
        self.requests += 1
        self.prompt_tokens += m.num_prompt_tokens
        self.cached_tokens += m.num_cached_tokens
        self.loaded_tokens += m.num_loaded_tokens
        self.prefilled_tokens += m.num_prefilled_tokens
        self.output_tokens += m.num_output_tokens
        self.preemptions += m.num_preemptions
        self.kv_load_s += m.kv_load_s
        self.kv_save_s += m.kv_save_s
