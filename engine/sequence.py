"""One request as the engine tracks it: its tokens, its KV blocks, and how far it has been computed."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.metrics import RequestMetrics
from engine.sampling import SamplingParams

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks allocated, KV arriving from the store (others run meanwhile)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``token_ids`` is prompt + output; tokens ``[:num_computed]`` have KV in ``block_table``."""

    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of the leading full blocks
    status: Status = Status.WAITING
    finish_reason: str | None = None
    preempted: bool = False
    text: str = ""
    streamed_text: str = ""  # of ``text``, what ``LLM.stream`` has handed out so far
    generator: torch.Generator | None = None
    session: str = ""  # the agent session this request is a turn of ("" = none; engine/sessions.py)
    critical: bool = False  # may use the device memory reserved for critical agents
    metrics: RequestMetrics | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.request_id = self.request_id or str(self.seq_id)
        self.metrics = RequestMetrics(self.arrival_time, num_prompt_tokens=len(self.prompt_token_ids))
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the newest sampled token lacks KV: the next step is a one-token decode."""
        return self.num_computed > 0 and self.num_uncomputed == 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
