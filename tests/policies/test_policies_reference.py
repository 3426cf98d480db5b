"""Fast policies against slow, obviously-correct reference implementations, and OPT against
exhaustive search."""

import functools
import random

from hypothesis import given, settings, strategies as st

from bench.sim import simulate_opt
from bench.traces import Trace
from kvstore.policies import make_policy
from kvstore.policies.arc import ARCPolicy
from kvstore.policies.lrfu import LRFUPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.shadow_vote import ShadowVotePolicy


def hits_of(policy, accesses, capacity):
    """Hit/miss sequence of ``policy`` on ``accesses`` (unit sizes, always insert)."""
    resident, out = set(), []
    for key in accesses:
        if key in resident:
            out.append(True)
            policy.on_hit(key)
            continue
        out.append(False)
        policy.on_miss(key)
        resident.add(key)
        policy.on_insert(key, 1, None)
        while len(resident) > capacity:
            resident.remove(policy.evict())
    return out


def reference_lru(accesses, capacity):
    stack, out = [], []  # most recent last
    for key in accesses:
        out.append(key in stack)
        if key in stack:
            stack.remove(key)
        stack.append(key)
        if len(stack) > capacity:
            stack.pop(0)
    return out


def reference_arc(accesses, c):
    """ARC exactly as in Megiddo & Modha's Figure 4; lists hold LRU first."""
    t1, t2, b1, b2, p, out = [], [], [], [], 0.0, []

    def replace(x):
        if t1 and ((x in b2 and len(t1) == p) or len(t1) > p):
            b1.append(t1.pop(0))
        else:
            b2.append(t2.pop(0))

    for x in accesses:
        if x in t1 or x in t2:
            out.append(True)
            (t1 if x in t1 else t2).remove(x)
            t2.append(x)
            continue
        out.append(False)
        if x in b1:
            p = min(c, p + max(len(b2) / len(b1), 1))
            replace(x)
            b1.remove(x)
            t2.append(x)
        elif x in b2:
            p = max(0, p - max(len(b1) / len(b2), 1))
            replace(x)
            b2.remove(x)
            t2.append(x)
        else:
            if len(t1) + len(b1) == c:
                if len(t1) < c:
                    b1.pop(0)
                    replace(x)
                else:
                    t1.pop(0)
            elif len(t1) + len(b1) + len(t2) + len(b2) >= c:
                if len(t1) + len(b1) + len(t2) + len(b2) == 2 * c:
                    b2.pop(0)
                replace(x)
            t1.append(x)
    return out


accesses = st.lists(st.integers(0, 25), max_size=400)
def _skewed(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [min(int(rng.paretovariate(1.2)), 10**6) % 40 for _ in range(n)]


zipfish = st.builds(_skewed, st.integers(0, 2**32), st.integers(0, 600))


@settings(max_examples=150, deadline=None)
@given(st.one_of(accesses, zipfish), st.integers(1, 12))
def test_lru_matches_reference(seq, capacity):
    assert hits_of(LRUPolicy(capacity), seq, capacity) == reference_lru(seq, capacity)


@settings(max_examples=150, deadline=None)
@given(st.one_of(accesses, zipfish), st.integers(1, 12))
def test_arc_matches_reference(seq, capacity):
    assert hits_of(ARCPolicy(capacity), seq, capacity) == reference_arc(seq, capacity)


@settings(max_examples=60, deadline=None)
@given(st.one_of(accesses, zipfish), st.integers(1, 12))
def test_shadow_vote_with_one_expert_is_that_expert(seq, capacity):
    alone = ShadowVotePolicy(capacity, experts=(ARCPolicy,), drop_tails=False)
    assert hits_of(alone, seq, capacity) == reference_arc(seq, capacity)


def reference_lrfu(accesses, capacity, half_life):
    """LRFU by its definition: every resident key's CRF is the sum of 2 ** (-age / half-life)
    over all its accesses so far (nothing forgotten); evict the least."""
    times: dict[int, list[int]] = {}
    resident, out = set(), []
    for now, key in enumerate(accesses):
        out.append(key in resident)
        times.setdefault(key, []).append(now)
        resident.add(key)
        if len(resident) > capacity:
            crf = {k: sum(2.0 ** (-(now - t) / (half_life * capacity)) for t in times[k]) for k in resident}
            resident.remove(min(resident, key=crf.__getitem__))
    return out


@settings(max_examples=150, deadline=None)
@given(st.one_of(accesses, zipfish), st.integers(1, 12), st.sampled_from([0.37, 1.7, 8.3]))
def test_lrfu_matches_reference(seq, capacity, half_life):
    # half-lives chosen so that two different access histories never have equal CRFs
    policy = LRFUPolicy(capacity, half_life=half_life, history=1e9)
    assert hits_of(policy, seq, capacity) == reference_lrfu(seq, capacity, half_life)


def brute_force_opt(seq, capacity):
    """Most hits any eviction/bypass schedule can get (exhaustive; tiny inputs only)."""

    @functools.lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(seq):
            return 0
        key = seq[i]
        if key in cache:
            return 1 + best(i + 1, cache)
        options = [best(i + 1, cache)]  # bypass
        if len(cache) < capacity:
            options.append(best(i + 1, cache | {key}))
        else:
            options += [best(i + 1, (cache - {v}) | {key}) for v in cache]
        return max(options)

    return best(0, frozenset())


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=14), st.integers(1, 3))
def test_opt_is_optimal(seq, capacity):
    trace = Trace("t", [[k] for k in seq])
    assert simulate_opt(trace, capacity).hits == brute_force_opt(tuple(seq), capacity)


def test_every_policy_stays_below_opt_on_a_skewed_trace():
    rng = random.Random(3)
    trace = Trace("t", [[int(rng.paretovariate(1.1)) % 300] for _ in range(5000)])
    opt = simulate_opt(trace, 30).hits
    for name in ("lru", "arc", "s3fifo", "lirs", "lrfu", "wtinylfu", "default"):
        assert hits_of(make_policy(name, 30), [r[0] for r in trace.requests], 30).count(True) <= opt
