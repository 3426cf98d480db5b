"""Multi-tenant workload mixes (``bench.workloads``): deterministic by seed, prefix-consistent
ids, the documented shape of each tenant kind, and activity windows."""

from collections import Counter

import pytest

from bench.traces import load_trace
from bench.workloads import KINDS, PRESETS, MixSpec, TenantSpec, generate, parse_spec


def _parents(requests):
    """Each block id's parent, checking that an id always has the same one."""
    parent_of = {}
    for request in requests:
        parent = None
        for key in request:
            assert parent_of.setdefault(key, parent) == parent, f"id {key} names two prefixes"
            parent = key
    return parent_of


def test_same_seed_same_trace_other_seed_other_trace():
    spec = parse_spec("workload:saas:requests=600,seed=7")
    assert generate(spec) == generate(spec)
    assert generate(spec)[0] != generate(parse_spec("workload:saas:requests=600,seed=8"))[0]


@pytest.mark.parametrize("name", PRESETS)
def test_presets_are_prefix_consistent_and_labelled(name):
    trace = load_trace(f"workload:{name}:requests=800")
    assert len(trace.requests) == len(trace.classes) == 800
    assert set(trace.classes) <= set(KINDS)
    _parents(trace.requests)
    head = trace.head(10)
    assert head.classes == trace.classes[:10]


def test_kinds_have_their_reuse_shapes():
    tenants = tuple(TenantSpec(kind, 1.0, corpus=20, think=0) for kind in KINDS)
    requests, kinds = generate(MixSpec(tenants, requests=3000, seed=3))
    seen = Counter(k for r in requests for k in r)
    system = {r[0] for r, kind in zip(requests, kinds) if kind != "oneoff"}
    by_kind = {kind: [r for r, k in zip(requests, kinds) if k == kind] for kind in KINDS}
    # batch and one-off blocks never come back (a batch job shares only its system prompt)
    for kind, skip in (("batch", 2), ("oneoff", 0)):
        assert all(seen[k] == 1 for r in by_kind[kind] for k in r[skip:])
    # chat turns extend the previous prompt of their conversation, so most chat blocks recur
    assert sum(seen[k] > 1 for r in by_kind["chat"] for k in r[2:]) > 0.5 * sum(len(r) - 2 for r in by_kind["chat"])
    # agents share a repository prefix at least 4 blocks long between sessions
    firsts = Counter(r[2] for r in by_kind["agent"])
    assert max(firsts.values()) > 10
    assert not system & {k for r in by_kind["oneoff"] for k in r}


def test_tenants_are_active_only_in_their_window():
    spec = MixSpec((TenantSpec("chat", 1.0), TenantSpec("batch", 5.0, start=0.25, end=0.5)), requests=2000)
    _, kinds = generate(spec)
    assert "batch" not in kinds[:500] + kinds[1000:]
    assert Counter(kinds[500:1000])["batch"] > 300
    with pytest.raises(ValueError, match="no tenant is active"):
        generate(MixSpec((TenantSpec("chat", 1.0, end=0.5),), requests=10))


@pytest.mark.parametrize("spec, match", [
    ("workload:nope", "unknown workload"),
    ("workload:saas:size=3", "bad workload option"),
    ("workload:saas:seed=x", "needs an integer"),
])
def test_bad_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        load_trace(spec)
