"""Scheduler (decode-first, chunked prefill, admission, preemption) and admission-order policies."""

import pytest

from engine.block_manager import BlockManager
from engine.policies import FCFS, QuotaBoundedAging, ShortestPromptFirst, make_policy
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, Status


def seq(n, arrival=0.0, start=0):
    return Sequence(list(range(start, start + n)), SamplingParams(max_tokens=8), arrival_time=arrival)


def run_step(sched, batch, next_token=1):
    """Apply a batch as the engine would: mark tokens computed, append a token where sampled."""
    for s, n in batch.items:
        s.num_computed += n
        sched.bm.register_full_blocks(s)
        if s.num_computed == len(s):
            s.token_ids.append(next_token)


def make(num_blocks=64, block_size=4, budget=64, max_seqs=8, policy="fcfs"):
    return Scheduler(BlockManager(num_blocks, block_size), make_policy(policy), max_seqs, budget)


def test_chunked_prefill_respects_token_budget():
    sched = make(budget=8)
    s = seq(20)
    sched.add(s)
    chunks = []
    while s.num_computed < 20:
        batch = sched.schedule(0.0)
        chunks.append(batch.num_tokens)
        run_step(sched, batch)
    assert chunks == [8, 8, 4]
    assert s.is_decoding


def test_decodes_come_first_then_prefill_chunks():
    sched = make(budget=6)
    a = seq(3)
    sched.add(a)
    run_step(sched, sched.schedule(0.0))
    b = seq(10, start=50)
    sched.add(b)
    batch = sched.schedule(0.0)
    assert batch.items[0] == (a, 1)
    assert batch.items[1] == (b, 5)


def test_admission_needs_kv_headroom():
    sched = make(num_blocks=4, block_size=4)
    a, b = seq(12), seq(8, start=100)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule(0.0)
    assert [s for s, _ in batch.items] == [a]
    assert b.status is Status.WAITING


def test_max_num_seqs_caps_running():
    sched = make(max_seqs=2)
    for i in range(4):
        sched.add(seq(3, start=10 * i))
    sched.schedule(0.0)
    assert len(sched.running) == 2 and len(sched.waiting) == 2


def test_preemption_frees_the_newest_and_resumes_it_first():
    sched = make(num_blocks=4, block_size=4)
    a, b = seq(4), seq(4, start=100)
    sched.add(a)
    sched.add(b)
    run_step(sched, sched.schedule(0.0))  # both prefilled: 2 blocks used, each needs a new one to decode
    run_step(sched, sched.schedule(0.0))  # both take their second block
    assert sched.bm.num_free == 0
    for _ in range(3):
        run_step(sched, sched.schedule(0.0))
    batch = sched.schedule(0.0)  # a needs a third block: b is preempted
    assert batch.preempted == [b]
    assert b.status is Status.WAITING and b.preempted and b.num_computed == 0
    assert b.metrics.num_preemptions == 1
    assert [s for s, _ in batch.items] == [a]
    sched.finish(a, "length")
    batch = sched.schedule(0.0)
    assert batch.items[0][0] is b and not b.preempted
    assert b.num_computed == 4  # its prompt block was still cached


def test_policies_by_name():
    assert isinstance(make_policy("fcfs"), FCFS)
    assert isinstance(make_policy("spf"), ShortestPromptFirst)
    assert isinstance(make_policy("qba"), QuotaBoundedAging)
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'"):
        make_policy("lifo")


def test_fcfs_orders_by_arrival():
    a, b, c = seq(50, 2.0), seq(5, 1.0), seq(20, 3.0)
    assert FCFS().order([a, b, c], now=4.0) == [b, a, c]


def test_spf_prefers_short_prompts_and_ages_long_ones():
    policy = ShortestPromptFirst(aging_tokens_per_s=10.0)
    long_old, short_new = seq(100, arrival=0.0), seq(10, arrival=5.0)
    assert policy.order([long_old, short_new], now=5.0) == [short_new, long_old]
    # a short request arriving 15 s later no longer overtakes it: waiting earned 150 tokens
    later = seq(10, arrival=15.0)
    assert policy.order([long_old, later], now=15.0) == [long_old, later]


def test_qba_promotes_a_starving_long_request():
    policy = QuotaBoundedAging(promote_after_s=1.0, quota=0.25, max_debt_tokens=100)
    long_old, short = seq(200, arrival=0.0), seq(10, arrival=0.5)
    assert policy.order([long_old, short], now=0.6) == [short, long_old]
    assert policy.order([long_old, short], now=2.0) == [long_old, short]
    policy.on_admit(long_old, now=2.0)
    assert policy.debt == pytest.approx(150)


def test_qba_quota_bounds_promoted_share_under_congestion():
    """A steady stream of short requests plus many old long ones: promoted tokens stay near the quota."""
    policy = QuotaBoundedAging(promote_after_s=1.0, quota=0.25, max_debt_tokens=200)
    waiting = [seq(100, arrival=0.0, start=i) for i in range(50)]
    promoted = total = 0
    now = 10.0
    for step in range(400):
        waiting.append(seq(10, arrival=now, start=10_000 + step))
        first = policy.order(waiting, now)[0]
        policy.on_admit(first, now)
        waiting.remove(first)
        total += len(first)
        promoted += len(first) if len(first) == 100 else 0
        now += 0.01
    assert 0 < promoted / total <= 0.25 + 200 / total + 0.05
    # without the debt cap the old long requests would take everything
    assert any(len(s) == 100 for s in waiting)
