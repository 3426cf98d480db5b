"""The agent sessions' knobs (engine/sessions.py, docs/agents.md): what a paused session's KV
becomes, how long its pins last, how stalls are predicted, and the scheduler's bounds."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("auto", "keep", "offload", "drop")


@dataclass
class AgentConfig:
    # auto: keep, offload or drop by the cost model (engine/stall_policy.py); keep: hold every
    # paused session's blocks on the device (released only when nothing else could run);
    # offload: always pin in the store and free the blocks; drop: free the blocks, pin nothing.
    policy: str = "auto"
    # A paused session's pins last pin_factor x the expected stall, within [min_pin_s, max_pin_s]
    # (TokenCake's 4x, 60 s .. 1 h): a late resume still finds its chunks, a vanished agent
    # holds nothing for long.
    pin_factor: float = 4.0
    min_pin_s: float = 60.0
    max_pin_s: float = 3600.0
    default_stall_s: float = 1.0  # the prediction with no history (TokenCake's)
    stall_ewma_alpha: float = 0.3  # weight of the newest stall in the per-tool and per-session estimates
    # Bytes of paused sessions' chunks kept pinned in the store; past it the sessions expected
    # back last are unpinned (their chunks may sink to lower tiers; resume_soon prefetches
    # them). None: half the in-process store's host RAM, no limit through a daemon. Pins
    # beyond the first tier's room would make it refuse new chunks.
    pin_budget_bytes: int | None = None
    save_tail: bool = True  # save the last partial chunk under a session-scoped key (connector/sessions.py)
    # The cost model's starting points, replaced by measurements as the engine runs.
    prefill_tokens_per_s: float = 2000.0
    load_bytes_per_s: float = 1e9
    # A resuming session whose KV is staged (resume_soon came, or it is held on the device) is
    # admitted ahead of a cold request at most this many times per cold request.
    resume_priority_bound: int = 4
    # Device memory (a fraction of the KV blocks) that only critical sessions' requests may use.
    critical_reserve_fraction: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"agents.policy: unknown value {self.policy!r}; known: {', '.join(POLICIES)}")
        for name in ("pin_factor", "min_pin_s", "max_pin_s", "default_stall_s", "prefill_tokens_per_s",
                     "load_bytes_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"agents.{name} must be positive, got {getattr(self, name)}")
        if self.pin_budget_bytes is not None and self.pin_budget_bytes < 0:
            raise ValueError(f"agents.pin_budget_bytes must not be negative, got {self.pin_budget_bytes}")
        if self.min_pin_s > self.max_pin_s:
            raise ValueError(f"agents.min_pin_s {self.min_pin_s} exceeds agents.max_pin_s {self.max_pin_s}")
        if not 0 < self.stall_ewma_alpha <= 1:
            raise ValueError(f"agents.stall_ewma_alpha must be in (0, 1], got {self.stall_ewma_alpha}")
        if self.resume_priority_bound < 0:
            raise ValueError(f"agents.resume_priority_bound must not be negative, got {self.resume_priority_bound}")
        if not 0 <= self.critical_reserve_fraction < 1:
            raise ValueError(f"agents.critical_reserve_fraction must be in [0, 1), got {self.critical_reserve_fraction}")
