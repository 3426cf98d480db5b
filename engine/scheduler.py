"""Continuous batching: each step packs decodes first, then prefill chunks, under a token budget.

- decode-first: every running sequence that only needs its newest token gets one slot;
- chunked prefill: a prompt longer than the remaining budget is computed over several steps;
- admission: waiting requests (preempted ones first, then in the policy's order) join only if
  all their blocks fit and the watermark stays free;
- preemption: when a decode needs a block and none is free, the most recently admitted
  running sequence loses its blocks and waits to be recomputed (its prefix may still hit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.policies import SchedulingPolicy
from engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """``items`` are (sequence, number of new tokens), decodes first."""

    items: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, policy: SchedulingPolicy,
                 max_num_seqs: int, max_num_batched_tokens: int):
        self.bm = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, now: float) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in [s for s in self.running if s.is_decoding]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted below to make room for an earlier one
            while not self.bm.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is Status.RUNNING:
                self.bm.append_slot(seq)
                batch.items.append((seq, 1))
                budget -= 1
        for seq in self.running:
            if budget == 0:
                break
            if not seq.is_decoding:
                n = min(seq.num_uncomputed, budget)
                batch.items.append((seq, n))
                budget -= n
        if not batch.preempted:
            budget = self._admit(now, budget, batch)
        return batch

    def _admit(self, now: float, budget: int, batch: ScheduledBatch) -> int:
        resumed = [s for s in self.waiting if s.preempted]
        fresh = self.policy.order([s for s in self.waiting if not s.preempted], now)
        for seq in resumed + fresh:
            if budget == 0 or len(self.running) >= self.max_num_seqs or not self.bm.can_allocate(seq):
                break
            reused = self.bm.allocate(seq)
            if not seq.preempted:
                self.policy.on_admit(seq, now)
                seq.metrics.num_cached_tokens = reused
                seq.metrics.first_scheduled_time = now
            seq.preempted = False
            seq.status = Status.RUNNING
            self.waiting.remove(seq)
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.items.append((seq, n))
            budget -= n
        return budget

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free_seq(seq)
        seq.status = Status.WAITING
        seq.preempted = True
        seq.metrics.num_preemptions += 1
        self.waiting.insert(0, seq)
        batch.preempted.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self.running.remove(seq)
        self.bm.free_seq(seq)
