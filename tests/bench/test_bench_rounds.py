"""bench/rounds.py: rounds in turns, medians with their spread, ratios as the median of the
per-round ratios, and the per-round over-limit flag."""

import pytest

from bench.limits import Limit
from bench.rounds import Spread, in_turns, limit_summary, over_limit, over_limit_lines, ratio


def test_in_turns_reverses_the_order_every_other_round_and_returns_results_in_step_order():
    calls = []

    def step(name):
        def run():
            calls.append(name)
            return name.upper()
        return run

    assert [in_turns(r, step("ours"), step("limit")) for r in range(3)] == [["OURS", "LIMIT"]] * 3
    assert calls == ["ours", "limit", "limit", "ours", "ours", "limit"]


def test_a_spread_is_the_median_with_the_smallest_and_largest():
    s = Spread.of([3.0, 1.0, 10.0, 2.0])
    assert (s.median, s.min, s.max) == (2.5, 1.0, 10.0)
    assert s.format() == "2.50 (1.00-10.00)"
    assert Spread.from_dict({**s.as_dict(), "other": 1}) == s
    with pytest.raises(ValueError):
        Spread.of([])


def test_a_ratio_is_the_median_of_per_round_ratios_not_the_ratio_of_medians():
    ours, base = [1.0, 4.0, 9.0], [1.0, 8.0, 3.0]  # per round 1.0, 0.5, 3.0; medians' ratio 4/3
    assert ratio(ours, base) == Spread(1.0, 0.5, 3.0)
    with pytest.raises(ValueError):
        ratio([1.0], [1.0, 2.0])


def test_a_limit_over_rounds_keeps_the_single_limits_keys():
    summary = limit_summary([Limit(2.0, "a"), Limit(5.0, "b"), Limit(3.0, "b")])
    assert summary == {"gbps": 3.0, "config": "b", "median": 3.0, "min": 2.0, "max": 5.0}


def test_over_limit_flags_each_round_beyond_noise_against_that_rounds_limit():
    limits = [Limit(10.0, "x"), Limit(10.0, "x"), Limit(20.0, "y")]
    flags = over_limit("get", [10.4, 10.6, 15.0], limits)  # only round 1: 10.6 > 10 * 1.05
    assert [(f["figure"], f["round"], f["limit_config"]) for f in flags] == [("get", 1, "x")]
    assert "round 1" in flags[0]["message"]
    assert over_limit_lines(flags) == [f"OVER LIMIT {flags[0]['message']}"]
    assert over_limit_lines([])[0].startswith("over limit: none")
