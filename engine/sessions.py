"""Agent sessions across tool calls: what a paused agent's KV becomes, and the events that steer it.

An agent session is a series of requests (turns) sharing an id; between turns the agent
waits on a tool. When a turn finishes, its blocks stay held ("parked") until the start of
the next engine step, so a ``pause`` sent right after the turn decides with the real
expected duration; without one the prediction decides (engine/stall_predictor.py). The
decision (engine/stall_policy.py) is one of:

- keep: the blocks stay held on the device; with the ``auto`` policy they are released
  (offloaded) as soon as a waiting request cannot be admitted without them;
- offload: the session's last partial chunk is saved under a session-scoped key, every
  chunk of it is pinned in the store for ``clamp(4 x stall, 60 s, 1 h)`` (the connector's
  ``pause_session``: connector/sessions.py), and the blocks are released. The full chunks
  were saved as they were computed; the next turn finds them by the connector's ordinary lookup;
- drop: the blocks are released and nothing is pinned.

``resume_soon(session, eta_s)`` prefetches the session's chunks into host RAM, stretches
its pins over the ETA, and marks it staged: the scheduler admits it ahead of cold requests
within a bound (engine/resume_priority.py). Events are advisory and idempotent: an unknown
session, a repeated or late event, a bad duration are no-ops or fall back to the
prediction; a pin always expires; an expired one just means a recompute. A session is
forgotten once its pins expire (or, without a store, its hold is gone) and it is idle.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from connector import KVConnector, valid_duration
from engine.agent_config import AgentConfig
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status
from engine.stall_policy import Costs, Decision, decide, pin_ttl
from engine.stall_predictor import StallPredictor

HOLDER = "\x1fsession\x1f"  # + the session id: a held session's request id in the block manager's books


class Residency(enum.Enum):
    ACTIVE = "active"  # a turn is queued or running
    PARKED = "parked"  # the turn finished; its blocks are held until this step's events are in
    KEPT = "kept"  # blocks held on the device through the stall
    OFFLOADED = "offloaded"  # chunks pinned in the store, blocks released
    DROPPED = "dropped"  # nothing held: the next turn recomputes what the caches lost


@dataclass
class BlockHold:
    """A paused session's blocks, held outside the scheduler's queues (the block manager's
    integrity check counts it as a holder, like a request)."""

    request_id: str
    block_table: list[int]
    num_computed: int
    critical: bool
    hard: bool  # the keep policy: released only when nothing else could run


@dataclass
class Session:
    id: str
    critical: bool = False
    state: Residency = Residency.ACTIVE
    turn: Sequence | None = None  # the latest request
    token_ids: list[int] = field(default_factory=list)  # tokens with KV when the last turn finished
    hold: BlockHold | None = None
    pinned_bytes: int = 0  # of the session's chunks the connector holds pinned for it
    pin_until: float = 0.0
    pin_pending_until: float = 0.0  # retry pins of chunks the saver had not put yet, until then
    finished_at: float | None = None
    expected_s: float | None = None  # from the latest pause event
    stall_s: float = 0.0  # the stall the last decision assumed
    tool: str = ""
    decision: Decision | None = None
    staged: bool = False  # resume_soon arrived for the coming turn


class SessionManager:
    PIN_RETRY_S = 2.0  # how long pins of chunks still in the saver's queue are retried

    def __init__(self, config: AgentConfig, bm: BlockManager, scheduler: Scheduler,
                 connector: KVConnector | None, kv_bytes_per_token: int, pin_budget_bytes: int | None = None,
                 clock=time.perf_counter) -> None:
        """``pin_budget_bytes``: at most so many bytes of paused sessions' chunks pinned (None: no limit)."""
        self.config, self.bm, self.scheduler, self.connector = config, bm, scheduler, connector
        self.kv_bytes_per_token = kv_bytes_per_token
        self.pin_budget_bytes = pin_budget_bytes
        self.clock = clock
        self.predictor = StallPredictor(config.default_stall_s, config.stall_ewma_alpha)
        self.sessions: dict[str, Session] = {}
        self.prefill_tokens_per_s = config.prefill_tokens_per_s
        self.counts = {d: 0 for d in Decision} | {"forced_releases": 0, "tails_saved": 0, "unpinned_over_budget": 0}

    # -- requests -----------------------------------------------------------------------------

    def on_add(self, seq: Sequence, now: float) -> None:
        """``seq`` is the session's next turn: the stall that ended is a sample for the predictor."""
        s = self.sessions.setdefault(seq.session, Session(seq.session))
        s.critical = s.critical or seq.critical
        seq.critical = s.critical
        if s.finished_at is not None and s.state is not Residency.ACTIVE:
            self.predictor.observe(now - s.finished_at, s.tool, s.id)
        s.state, s.turn, s.expected_s, s.decision = Residency.ACTIVE, seq, None, None

    def on_finish(self, seq: Sequence, now: float) -> None:
        """Before the engine frees ``seq``'s blocks: hold the ones with KV until the events are in."""
        s = self.sessions.get(seq.session)
        if s is None or s.turn is not seq:
            return
        n = seq.num_computed
        s.token_ids = seq.token_ids[:n]
        s.finished_at = now
        s.state = Residency.PARKED
        if s.hold is not None:  # an earlier turn's hold the next one never took over
            self._release_hold(s)
        blocks = seq.block_table[:self.bm.blocks_needed(n)]
        if blocks:
            self.bm.share(blocks)
            s.hold = BlockHold(HOLDER + s.id, list(blocks), n, s.critical, self.config.policy == "keep")
            self.scheduler.held.append(s.hold)

    # -- events -------------------------------------------------------------------------------

    def pause(self, session: str, expected_s=None, tool: str = "") -> bool:
        """The session's agent waits on a tool for about ``expected_s``. Returns whether the
        event applied (False: an unknown session, a no-op)."""
        s = self.sessions.get(session)
        if s is None:
            return False
        s.expected_s = valid_duration(expected_s)
        s.tool = tool or s.tool
        if s.state is Residency.ACTIVE:
            return True  # the turn is still running: the decision waits for its end
        self._decide(s, self.clock(), by_event=True)
        return True

    def resume_soon(self, session: str, eta_s) -> bool:
        """The session's next turn comes in about ``eta_s``: bring its chunks up to host RAM,
        keep them pinned past the ETA, and mark it staged."""
        s = self.sessions.get(session)
        if s is None or s.state is Residency.ACTIVE:
            return False
        eta = valid_duration(eta_s) or 0.0
        s.staged = True
        if self.connector is not None:
            ttl = pin_ttl(eta, self.config.pin_factor, self.config.min_pin_s, self.config.max_pin_s)
            self._pin(s, self.clock(), ttl)
            self.connector.resume_session(s.id, s.token_ids)
        return True

    def end(self, session: str) -> bool:
        """The session is over: release everything it holds now."""
        s = self.sessions.get(session)
        if s is None or s.state is Residency.ACTIVE:
            return False
        self._forget(s)
        return True

    # -- each step ------------------------------------------------------------------------------

    def before_step(self, now: float) -> None:
        for s in list(self.sessions.values()):
            if s.state is Residency.PARKED:  # a pause sent while the turn ran still counts
                self._decide(s, now, by_event=s.expected_s is not None)
            if s.state is Residency.ACTIVE:
                if s.turn is not None and s.turn.status is not Status.WAITING:
                    self._took_over(s)  # admitted: its own blocks and lookup pins hold the KV now
                continue
            if s.pinned_bytes and s.pin_pending_until > now:
                self._pin(s, now, s.pin_until - now)
            if s.pin_until <= now:  # the lease is over: held blocks and pins alike go
                self._forget(s)
        self._relieve_pressure()

    def observe_forward(self, tokens: int, seconds: float) -> None:
        """A forward of ``tokens`` took ``seconds``: the prefill rate of the cost model."""
        if tokens >= 64 and seconds > 0:
            alpha = self.config.stall_ewma_alpha
            self.prefill_tokens_per_s = (1 - alpha) * self.prefill_tokens_per_s + alpha * tokens / seconds

    # -- decisions ------------------------------------------------------------------------------

    def _decide(self, s: Session, now: float, by_event: bool) -> None:
        stall = s.expected_s if by_event and s.expected_s is not None else self.predictor.predict(s.tool, s.id)
        decision = self._choose(s, stall)
        if s.decision is Decision.DROP or (s.decision is Decision.OFFLOAD and decision is Decision.KEEP):
            decision = s.decision  # the blocks are gone; a later event can only stretch the pins
        s.decision, s.stall_s = decision, stall
        self.counts[decision] += 1
        ttl = pin_ttl(stall, self.config.pin_factor, self.config.min_pin_s, self.config.max_pin_s)
        s.pin_until = max(s.pin_until, now + ttl)  # the lease on whatever the session keeps, and its record
        if decision is Decision.KEEP:
            s.state = Residency.KEPT
            if self.connector is not None:
                self._pin(s, now, ttl)  # so that a release under pressure still finds the chunks
        elif decision is Decision.OFFLOAD:
            self._offload(s, now, ttl)
        else:
            s.state = Residency.DROPPED
            self._release_hold(s)

    def _choose(self, s: Session, stall: float) -> Decision:
        forced = {"keep": Decision.KEEP, "offload": Decision.OFFLOAD, "drop": Decision.DROP}.get(self.config.policy)
        if forced is not None:
            return Decision.DROP if forced is Decision.OFFLOAD and self.connector is None else forced
        n = len(s.token_ids)
        blocks = len(s.hold.block_table) if s.hold else 0
        nbytes = n * self.kv_bytes_per_token
        return decide(Costs(stall, n, nbytes, blocks, len(self.bm.blocks), self.prefill_tokens_per_s,
                            self.load_bytes_per_s(), can_offload=self.connector is not None))

    def _offload(self, s: Session, now: float, ttl: float) -> None:
        s.state = Residency.OFFLOADED
        tail_from = s.hold.block_table if self.config.save_tail and s.hold is not None else None
        self._pin(s, now, ttl, tail_from)
        self._release_hold(s)

    def _relieve_pressure(self) -> None:
        """A waiting request that does not fit while sessions hold blocks: release soft holds
        (latest expected return first); hard ones (the keep policy) only when nothing runs."""
        sched = self.scheduler
        if not sched.waiting or not sched.held:
            return
        head = min(sched.waiting, key=lambda q: (not q.preempted, q.arrival_time, q.seq_id))
        idle = not sched.running and not sched.loading
        while not self.bm.can_allocate(head):
            holds = [s for s in self.sessions.values() if s.hold is not None and s.id != head.session
                     and (idle or not s.hold.hard)]
            if not holds:
                return
            s = max(holds, key=lambda x: (x.finished_at or 0) + (x.expected_s or 0))
            self.counts["forced_releases"] += 1
            if self.connector is not None and s.decision is not Decision.DROP:
                self._offload(s, self.clock(), max(1.0, s.pin_until - self.clock()))
            else:
                self._release_hold(s)
                s.state, s.decision = Residency.DROPPED, Decision.DROP

    # -- helpers ----------------------------------------------------------------------------------

    def _took_over(self, s: Session) -> None:
        self._release_hold(s)
        self._unpin_session(s)
        s.staged = False
        s.pin_until = s.pin_pending_until = 0.0

    def _release_hold(self, s: Session) -> None:
        if s.hold is not None:
            self.scheduler.held.remove(s.hold)
            self.bm.release(s.hold.block_table)
            s.hold = None

    def _pin(self, s: Session, now: float, ttl: float, tail_from: list[int] | None = None) -> None:
        """Pin the session's chunks for ``ttl`` (extends, never shortens), after saving its
        tail from ``tail_from`` (its device blocks) if given; chunks still in the saver's queue
        are pinned on a later step, for a short while."""
        pins = self.connector.pause_session(s.id, s.token_ids, ttl, tail_from)
        self.counts["tails_saved"] += pins.tail_saved
        s.pinned_bytes = pins.nbytes
        if not pins.applied:
            return
        s.pin_until = max(s.pin_until, now + ttl)
        if pins.missing:
            s.pin_pending_until = s.pin_pending_until or now + self.PIN_RETRY_S
        else:
            s.pin_pending_until = 0.0
        self._within_pin_budget(s)

    def _within_pin_budget(self, newest: Session) -> None:
        """Over the budget, unpin the paused sessions expected back last (never a staged one,
        nor the one just pinned while another can go): their chunks stay in the store,
        evictable to lower tiers."""
        if self.pin_budget_bytes is None:
            return
        pinned = [s for s in self.sessions.values() if s.pinned_bytes and s.state is not Residency.ACTIVE]
        total = sum(s.pinned_bytes for s in pinned)
        for s in sorted(pinned, key=lambda x: (x.staged, x is newest, -((x.finished_at or 0) + x.stall_s))):
            if total <= self.pin_budget_bytes or s.staged:
                return
            total -= s.pinned_bytes
            self._unpin_session(s)
            s.pin_pending_until = 0.0
            self.counts["unpinned_over_budget"] += 1

    def _unpin_session(self, s: Session) -> None:
        if self.connector is not None:
            self.connector.unpin_session(s.id)
        s.pinned_bytes = 0

    def _forget(self, s: Session) -> None:
        self._release_hold(s)
        if self.connector is not None:
            self.connector.end_session(s.id)
        self.predictor.forget(s.id)
        del self.sessions[s.id]

    def load_bytes_per_s(self) -> float:
        stats = self.connector.stats() if self.connector is not None else None
        if stats is not None and stats.loads and stats.load_s > 0:
            return stats.loaded_bytes / stats.load_s
        return self.config.load_bytes_per_s

    # -- checks -----------------------------------------------------------------------------------

    def staged(self, seq: Sequence) -> bool:
        """Whether ``seq`` is a resuming turn whose KV is staged (resume_soon, or held on the device)."""
        s = self.sessions.get(seq.session) if seq.session else None
        return s is not None and s.turn is seq and (s.staged or s.hold is not None)

    def close(self) -> None:
        """Release every hold and pin (the engine is closing)."""
        for s in list(self.sessions.values()):
            s.state = Residency.DROPPED
            self._forget(s)
