"""Admission-order policies for waiting requests, selectable by name (``fcfs``, ``spf``, ``qba``).

A policy only orders the waiting queue; the scheduler admits in that order while the token
budget and KV headroom last, and tells the policy whom it admitted.
"""

from __future__ import annotations

from typing import Protocol

from engine.sequence import Sequence


class SchedulingPolicy(Protocol):
    name: str

    def order(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        """The order in which to try to admit ``waiting``."""

    def on_admit(self, seq: Sequence, now: float) -> None:
        """``seq`` was admitted (called in admission order)."""


class FCFS:
    """First come, first served."""

    name = "fcfs"

    def order(self, waiting, now):
        return sorted(waiting, key=lambda s: (s.arrival_time, s.seq_id))

    def on_admit(self, seq, now):
        pass


class ShortestPromptFirst:
    """Shortest prompt first; waiting earns ``aging_tokens_per_s`` of priority so nobody starves."""

    name = "spf"

    def __init__(self, aging_tokens_per_s: float = 200.0):
        self.aging_tokens_per_s = aging_tokens_per_s

    def key(self, seq: Sequence, now: float) -> tuple[float, float, int]:
        waited = now - seq.arrival_time
        return (len(seq) - self.aging_tokens_per_s * waited, seq.arrival_time, seq.seq_id)

    def order(self, waiting, now):
        return sorted(waiting, key=lambda s: self.key(s, now))

    def on_admit(self, seq, now):
        pass


class QuotaBoundedAging:
    """Shortest prompt first, but a request waiting ``promote_after_s`` or more jumps the queue.

    Promotions are paid for: each promoted token adds ``1 - quota`` to a debt, each token
    admitted in normal order repays ``quota``, and nobody is promoted while the debt is at
    least ``max_debt_tokens``. So under congestion promoted (long, old) requests get about a
    ``quota`` share of admitted tokens and cannot take over; when the queue is calm they are
    admitted promptly.
    """

    name = "qba"

    def __init__(self, promote_after_s: float = 1.0, quota: float = 0.25, max_debt_tokens: float = 1024.0):
        if not 0 < quota < 1:
            raise ValueError(f"quota must be in (0, 1), got {quota}")
        self.promote_after_s = promote_after_s
        self.quota = quota
        self.max_debt_tokens = max_debt_tokens
        self.debt = 0.0
        self._promoted: int | None = None

    def order(self, waiting, now):
        base = sorted(waiting, key=lambda s: (len(s), s.arrival_time, s.seq_id))
        self._promoted = None
        if self.debt >= self.max_debt_tokens:
            return base
        starving = [s for s in base[1:] if now - s.arrival_time >= self.promote_after_s]
        if not starving:
            return base
        oldest = min(starving, key=lambda s: (s.arrival_time, s.seq_id))
        self._promoted = oldest.seq_id
        return [oldest] + [s for s in base if s is not oldest]

    def on_admit(self, seq, now):
        if seq.seq_id == self._promoted:
            self.debt += (1 - self.quota) * len(seq)
            self._promoted = None
        else:
            self.debt = max(0.0, self.debt - self.quota * len(seq))


POLICIES = {"fcfs": FCFS, "spf": ShortestPromptFirst, "qba": QuotaBoundedAging}


def make_policy(name: str) -> SchedulingPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}")
    return POLICIES[name]()
