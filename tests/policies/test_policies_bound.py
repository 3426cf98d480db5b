"""The experts bound: on random traces ``shadow-vote`` gets about as many hits as the best
of its experts run alone, or more.

A cache cannot switch to another policy's contents for free, so this is a regret bound we
measured and state, not a theorem: the first accesses follow the first expert (LRU) before
any score exists (the first windows are short, so a trace shorter than one window is scored
too), and afterwards the vote lags a changing leader by a little. The bound allowed is a
quarter of a full window plus 1% of all accesses."""

import random

from hypothesis import example, given, settings, strategies as st

from bench.sim import simulate
from bench.traces import Trace
from kvstore.policies.shadow_vote import EXPERT_POLICIES, WINDOW, ShadowVotePolicy


def regret_bound(accesses: int) -> int:
    return min(WINDOW, accesses) // 4 + accesses // 100


def prefix_trace(seed: int, requests: int, documents: int, skew: float, tails: float) -> Trace:
    """Requests over documents of Zipf popularity, each a chain of blocks read from the
    start to a random depth, some ending with a unique partly filled block."""
    rng = random.Random(seed)
    lengths = [rng.randint(1, 12) for _ in range(documents)]
    weights = [1 / (r + 1) ** skew for r in range(documents)]
    out = []
    for i in range(requests):
        doc = rng.choices(range(documents), weights)[0]
        request = [(doc, j) for j in range(rng.randint(1, lengths[doc]))]
        out.append(request + ([("tail", i)] if rng.random() < tails else []))
    return Trace("random", out)


def flat_trace(seed: int, accesses: int, keys: int, skew: float) -> Trace:
    """Single-block requests: no prefix structure, so the tail rule never fires."""
    rng = random.Random(seed)
    return Trace("flat", [[int(rng.paretovariate(skew)) % keys if rng.random() < 0.7 else rng.randrange(3 * keys)]
                         for _ in range(accesses)])


traces = st.one_of(
    st.builds(prefix_trace, st.integers(0, 2**32), st.integers(50, 600), st.integers(5, 300),
              st.floats(0.3, 1.5), st.floats(0, 1)),
    st.builds(flat_trace, st.integers(0, 2**32), st.integers(200, 6000), st.integers(10, 1000), st.floats(0.5, 1.5)),
)


@settings(max_examples=40, deadline=None)
@given(traces, st.floats(0.01, 0.3))
@example(prefix_trace(240, 77, 5, 1.0, 0.0), 0.25)  # shorter than a window: once followed LRU throughout (53 hits, LRFU 121)
def test_shadow_vote_is_within_the_regret_bound_of_its_best_expert(trace, share):
    capacity = max(2, int(trace.distinct * share))
    best = max(simulate(trace, make(capacity), capacity).hits for make in EXPERT_POLICIES.values())
    ours = simulate(trace, ShadowVotePolicy(capacity), capacity, check=True).hits
    assert ours >= best - regret_bound(trace.accesses), (best, ours, trace.accesses, capacity)
