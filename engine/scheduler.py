"""Continuous batching: each step packs decodes first, then prefill chunks, under a token budget.

- decode-first: every running sequence that only needs its newest token gets one slot;
- chunked prefill: a prompt longer than the remaining budget is computed over several steps;
- admission: waiting requests (preempted ones first, then in the policy's order) join only if
  all their blocks fit and the watermark stays free;
- preemption: when a decode needs a block and none is free, the most recently admitted
  running sequence loses its blocks and waits to be recomputed (its prefix may still hit).

With a KV connector, admission asks it, after the local prefix match and before allocation,
how many further tokens the store can supply. Loaded tokens count as computed, except that
the last prompt token is always computed (its logits give the first output token). A request
whose KV arrives asynchronously waits in ``loading`` (WAITING_FOR_KV) while others run; a
load that failed makes its request recompute from the first block that did not arrive.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from connector import ConnectorOutput, KVConnector
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
                 max_num_seqs: int, max_num_batched_tokens: int, connector: KVConnector | None = None,
                 critical_reserve_blocks: int = 0):
        self.bm = block_manager
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.connector = connector
        # Block holders outside the queues: agent sessions keeping their KV on the device
        # through a stall (engine/sessions.py); each has block_table, request_id, critical.
        self.held: list = []
        self.critical_reserve_blocks = critical_reserve_blocks
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.loading: list[Sequence] = []  # WAITING_FOR_KV

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

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
            if budget == 0 or len(self.running) + len(self.loading) >= self.max_num_seqs \
                    or not self.bm.can_allocate(seq):
                break
            if not seq.preempted and not self.bm.can_allocate(seq, self._reserved_for_critical(seq)):
                # the rest of the memory is reserved for critical agents (a preempted request
                # resumes into it, as into the watermark: it held those blocks, grown by decodes)
                continue
            external, load_async = 0, False
            if self.connector is not None:
                external, load_async = self.connector.get_num_new_matched_tokens(seq, self.bm.num_cached_tokens(seq))
            local = self.bm.allocate(seq)
            if self.connector is not None:
                self.connector.update_state_after_alloc(seq, external)
            if not seq.preempted:
                self.policy.on_admit(seq, now)
                seq.metrics.num_cached_tokens = local
                seq.metrics.first_scheduled_time = now
            seq.preempted = False
            self.waiting.remove(seq)
            if load_async:
                seq.status = Status.WAITING_FOR_KV
                self.loading.append(seq)
                continue
            seq.num_computed = min(local + external, len(seq) - 1)  # the last prompt token is always computed
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.items.append((seq, n))
            budget -= n
        return budget

    def _reserved_for_critical(self, seq: Sequence) -> int:
        """Blocks a request of a non-critical agent must leave free: the part of the critical
        agents' reservation they do not use now."""
        if seq.critical or not self.critical_reserve_blocks:
            return 0
        used = sum(len(s.block_table) for s in self.running + self.loading + self.held if s.critical)
        return max(0, self.critical_reserve_blocks - used)

    def on_connector_output(self, output: ConnectorOutput) -> set[Sequence]:
        """Apply finished loads. An asynchronous one moves its request to ``running`` with the
        loaded tokens computed; a failed synchronous one means this step computed that request
        on KV that never arrived: it restarts from its first failed block, and the step's
        result for it is void. Returns those voided requests."""
        by_id = {s.request_id: s for s in self.running + self.loading}
        failed_blocks = output.failed_block_ids
        voided = set()
        for result in output.loads:
            seq = by_id[result.request_id]
            seq.metrics.num_loaded_tokens += result.loaded_tokens
            seq.metrics.kv_load_s += result.seconds
            if seq.status is Status.WAITING_FOR_KV:
                seq.num_computed = min(seq.num_computed + result.loaded_tokens, len(seq) - 1)
                seq.status = Status.RUNNING
                self.loading.remove(seq)
                self.running.append(seq)
            elif not result.ok:
                first = next(i for i, b in enumerate(seq.block_table) if b in failed_blocks)
                seq.num_computed = first * self.bm.block_size
                voided.add(seq)
        for request_id, seconds in output.save_seconds.items():
            if request_id in by_id:
                by_id[request_id].metrics.kv_save_s += seconds
        if self.connector is not None:
            self.connector.update_connector_output(output)
        return voided

    def check_integrity(self) -> None:
        """Raise AssertionError unless requests and blocks balance: each request is in exactly
        one queue matching its status, and the block manager's books balance for the holders."""
        queues = {Status.WAITING: self.waiting, Status.RUNNING: self.running, Status.WAITING_FOR_KV: self.loading}
        seen = set()
        for status, seqs in queues.items():
            for seq in seqs:
                assert seq.status is status, f"{seq.request_id} is {seq.status} in the {status.value} queue"
                assert seq.seq_id not in seen, f"{seq.request_id} is queued twice"
                seen.add(seq.seq_id)
        for seq in self.waiting:
            assert not seq.block_table, f"waiting {seq.request_id} holds blocks"
        self.bm.check_integrity(self.running + self.loading + self.held)
        if self.connector is not None and not self.has_unfinished():
            self.connector.check_idle()

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        if self.connector is not None:
            self.connector.on_preempt(seq)
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
        if self.connector is not None:
            self.connector.request_finished(seq)
        self.bm.free_seq(seq)
