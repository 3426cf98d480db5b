"""Staged resumers first, within a bound: an admission order around any scheduling policy.

A resuming agent turn whose KV is staged (``resume_soon`` came, or its blocks are held on
the device) is cheap to admit and was promised a quick return, so it is tried ahead of cold
requests. Each time one is admitted ahead of a cold request that the inner policy ranks
before it, that request is bypassed once; a request bypassed ``bound`` times is tried ahead
of every staged resumer from then on, so a stream of resumers never starves the others.
A bound of 0 turns the priority off.
"""

from __future__ import annotations

from typing import Callable

from engine.policies import SchedulingPolicy
from engine.sequence import Sequence, Status


class ResumePriority:
    def __init__(self, inner: SchedulingPolicy, staged: Callable[[Sequence], bool], bound: int) -> None:
        self.inner, self.staged, self.bound = inner, staged, bound
        self.name = inner.name
        self._bypassed: dict[int, int] = {}  # seq_id -> times a staged resumer went ahead of it
        self._last: list[Sequence] = []  # the inner policy's last order

    def order(self, waiting: list[Sequence], now: float) -> list[Sequence]:
        ranked = self.inner.order(waiting, now)
        self._last = ranked
        staged = [s for s in ranked if self.staged(s)] if self.bound else []
        if not staged:  # none, or the priority is off (bound 0)
            return ranked
        cold = [s for s in ranked if not self.staged(s)]
        due = [s for s in cold if self._bypassed.get(s.seq_id, 0) >= self.bound]
        return due + staged + [s for s in cold if self._bypassed.get(s.seq_id, 0) < self.bound]

    def on_admit(self, seq: Sequence, now: float) -> None:
        self._bypassed.pop(seq.seq_id, None)
        if self.staged(seq) and seq in self._last:
            for other in self._last[:self._last.index(seq)]:
                if not self.staged(other) and other.status is Status.WAITING:
                    self._bypassed[other.seq_id] = self._bypassed.get(other.seq_id, 0) + 1
        self.inner.on_admit(seq, now)
