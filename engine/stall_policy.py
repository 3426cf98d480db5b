"""What a paused agent's KV becomes during its stall: kept on the device, offloaded to the
store (pinned there, device blocks freed), or dropped (recomputed on resume).

The cost model is placement's (kvstore/store/placement.py): recomputing costs tokens / the prefill
rate, loading costs bytes / the tier's read bandwidth, both in seconds the engine spends on
the resume. Keeping costs the device memory the session holds for the stall: a fraction f of
the KV blocks for s seconds is f x s device-seconds other requests cannot use. So

    resume_s = min(load_s, recompute_s)          (offload when loading is cheaper)
    keep     iff  f x s  <  resume_s             (the stall is too short to pay for a resume)

Offloading costs little up front: the connector saves every full chunk as it is computed,
so a pause only adds the tail and the pins.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from connector import pin_ttl  # one lease rule for the engine's pauses and the daemon's

__all__ = ["Costs", "Decision", "decide", "pin_ttl"]


class Decision(enum.Enum):
    KEEP = "keep"
    OFFLOAD = "offload"
    DROP = "drop"


@dataclass(frozen=True)
class Costs:
    """The inputs of one decision, in seconds, tokens, bytes and blocks."""

    stall_s: float
    tokens: int  # with KV
    nbytes: int  # of that KV
    blocks: int  # device blocks the session holds
    num_blocks: int  # device blocks in all
    prefill_tokens_per_s: float
    load_bytes_per_s: float
    can_offload: bool = True  # a store is there to offload to

    @property
    def recompute_s(self) -> float:
        return self.tokens / self.prefill_tokens_per_s

    @property
    def load_s(self) -> float:
        return self.nbytes / self.load_bytes_per_s

    @property
    def resume_s(self) -> float:
        return min(self.load_s, self.recompute_s) if self.can_offload else self.recompute_s

    @property
    def keep_s(self) -> float:
        """Device-seconds the session's blocks are unusable by others if kept."""
        return self.blocks / self.num_blocks * self.stall_s


def decide(costs: Costs) -> Decision:
    if costs.keep_s < costs.resume_s:
        return Decision.KEEP
    return Decision.OFFLOAD if costs.can_offload and costs.load_s < costs.recompute_s else Decision.DROP
