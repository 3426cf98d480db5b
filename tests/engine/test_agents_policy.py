"""The pure parts of agent sessions: the stall predictor, the keep/offload/drop cost model and
pin leases, the bounded priority of staged resumers, the critical agents' reservation, and
the agent configuration's errors."""

import math

import pytest

from engine.agent_config import AgentConfig
from engine.block_manager import BlockManager
from engine.policies import FCFS
from engine.resume_priority import ResumePriority
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stall_policy import Costs, Decision, decide, pin_ttl
from engine.stall_predictor import StallPredictor


def test_the_predictor_learns_per_tool_and_per_session_and_ignores_bad_samples():
    p = StallPredictor(default_s=1.0, alpha=0.5)
    assert p.predict("search", "a") == 1.0
    p.observe(4.0, "search", "a")
    assert p.predict("search", "b") == 4.0  # the tool's history for a new session
    assert p.predict("code", "a") == 4.0  # the session's history for a new tool
    p.observe(2.0, "search", "")
    assert p.predict("search", "") == 3.0  # EWMA: 0.5 x 4 + 0.5 x 2
    assert p.predict("search", "a") == (3.0 + 4.0) / 2  # both known: their mean
    for bad in (-1.0, math.nan, math.inf):
        p.observe(bad, "search", "a")
    assert p.predict("search", "a") == 3.5
    p.forget("a")
    assert p.predict("", "a") == 1.0


def costs(stall_s, tokens=1000, bytes_per_token=46080, blocks=63, num_blocks=128, tps=500.0, bps=2e9, store=True):
    return Costs(stall_s, tokens, tokens * bytes_per_token, blocks, num_blocks, tps, bps, store)


def test_the_cost_model_keeps_short_stalls_offloads_long_ones_and_drops_without_a_store():
    # loading 46 MB at 2 GB/s: 23 ms; keeping half the device for s seconds costs s / 2
    assert decide(costs(0.01)) is Decision.KEEP
    assert decide(costs(1.0)) is Decision.OFFLOAD
    # without a store the alternative is recomputing (2 s): keep below 4 s, drop above
    assert decide(costs(3.0, store=False)) is Decision.KEEP
    assert decide(costs(5.0, store=False)) is Decision.DROP
    # a tier slower than recomputing: drop rather than offload
    assert decide(costs(60.0, bps=1e6)) is Decision.DROP
    c = costs(2.0)
    assert c.keep_s == pytest.approx(63 / 128 * 2.0) and c.resume_s == c.load_s


def test_pin_leases_follow_the_stall_within_bounds():
    assert pin_ttl(1.0, 4.0, 60.0, 3600.0) == 60.0
    assert pin_ttl(100.0, 4.0, 60.0, 3600.0) == 400.0
    assert pin_ttl(1e9, 4.0, 60.0, 3600.0) == 3600.0


def seq(n, arrival, session=""):
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=2), arrival, session=session)


def test_staged_resumers_go_first_but_a_cold_request_is_bypassed_at_most_bound_times():
    staged = set()
    policy = ResumePriority(FCFS(), lambda s: s.session in staged, bound=2)
    cold = seq(8, 0.0)
    waiting = [cold]
    for i in range(4):
        resumer = seq(8, 1.0 + i, session=f"r{i}")
        staged.add(resumer.session)
        order = policy.order(waiting + [resumer], now=10.0)
        if i < 2:
            assert order == [resumer, cold]
            policy.on_admit(resumer, 10.0)
        else:
            assert order == [cold, resumer]  # bypassed twice: its turn
    policy.on_admit(cold, 10.0)
    assert policy.order([seq(8, 5.0), resumer], 10.0)[0] is resumer


def test_unstaged_requests_and_a_zero_bound_keep_the_inner_order():
    a, b = seq(8, 1.0, "x"), seq(8, 0.5)
    assert ResumePriority(FCFS(), lambda s: False, bound=2).order([a, b], 2.0) == [b, a]
    assert ResumePriority(FCFS(), lambda s: s is a, bound=0).order([a, b], 2.0) == [b, a]


def test_critical_agents_have_memory_others_cannot_take():
    bm = BlockManager(num_blocks=20, block_size=4)
    sched = Scheduler(bm, FCFS(), max_num_seqs=8, max_num_batched_tokens=256, critical_reserve_blocks=8)
    big = seq(13 * 4, 0.0)  # 13 blocks (+ room for its output) would eat into the reserved 8
    small = seq(4 * 4 - 1, 0.1)  # 4 blocks fit beside the reservation
    critical = seq(7 * 4, 0.2)
    critical.critical = True
    for s in (big, small, critical):
        sched.add(s)
    sched.schedule(0.0)
    assert big.status.value == "waiting"
    assert small.status.value == "running" and critical.status.value == "running"
    sched.check_integrity()


@pytest.mark.parametrize("bad", [dict(policy="sometimes"), dict(min_pin_s=0), dict(min_pin_s=100, max_pin_s=10),
                                 dict(stall_ewma_alpha=0), dict(resume_priority_bound=-1),
                                 dict(critical_reserve_fraction=1.0), dict(pin_budget_bytes=-1)])
def test_bad_agent_configuration_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="agents\\."):
        AgentConfig(**bad)


def test_block_holds_share_and_release():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(10, 0.0)
    bm.allocate(s)  # 3 blocks
    held = list(s.block_table)
    bm.share(held)
    bm.free_seq(s)
    assert bm.num_free == 5  # the hold keeps them
    with pytest.raises(ValueError, match="is free"):
        bm.share([next(iter(bm.free))])
    bm.release(held)
    assert bm.num_free == 8
    bm.check_integrity([])
