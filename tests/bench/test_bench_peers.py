"""``kvbench peers``: ours beside the limits (and beside a peer: here a second Store, since
LMCache is no dependency), as medians of interleaved rounds; says how to install LMCache."""

import json
import os
import statistics

from bench import peers
from bench.cli import main
from bench.limits import Limit

ARGS = ["peers", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--chunks", "4"]


class Twin(peers.Ours):
    """A stand-in for LMCache: another Store, in its own directory."""

    name = "twin"

    def __init__(self, ns, chunks, chunk_bytes, root, rounds) -> None:
        super().__init__(ns, chunks, chunk_bytes, os.path.join(root, "twin"))


def _spread(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def test_peers_without_a_peer_reports_medians_of_rounds_against_each_rounds_limits(tmp_path, capsys):
    out = tmp_path / "peers.json"
    assert main([*ARGS, "--peer", "none", "--rounds", "3", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    (name,) = report["rounds"]
    ours = report["rounds"][name]
    assert len(ours) == 3 and all(r[p] > 0 for r in ours for p in peers.PHASES)
    # every put timed: its median and P99 beside the throughput
    assert all(len(r["put_ms"]) == 4 and 0 < r["put_p50_ms"] <= r["put_p99_ms"] <= max(r["put_ms"]) for r in ours)
    for kind in ("memcpy", "disk_read"):
        per_round = [limits[kind] for limits in report["round_limits"]]
        assert all(limit["gbps"] == max(limit["tried"].values()) for limit in per_round)
        assert [limit["gbps"] for limit in per_round] == [r[kind]["gbps"] for r in ours]  # one system: its own
        assert {k: report["limits"][kind][k] for k in ("median", "min", "max")} == _spread([l["gbps"] for l in per_round])
    for phase in peers.PHASES:
        assert report["figures"][name][phase] == _spread([r[phase] for r in ours])
    kind = peers.LIMIT_OF["cold_get"]
    assert report["vs_limit"][name]["cold_get"] == _spread([r["cold_get"] / r[kind]["gbps"] for r in ours])
    assert "ours_vs_peer" not in report and isinstance(report["over_limit"], list)
    text = capsys.readouterr().out
    assert "3 rounds" in text and "median (min-max)" in text


def test_a_peer_runs_in_turns_and_ours_over_it_is_the_median_of_per_round_ratios(tmp_path, monkeypatch):
    order = []
    real_round = peers._round

    def recorded(system, *args):
        order.append(system.name)
        return real_round(system, *args)

    monkeypatch.setattr(peers, "_peer", lambda name: Twin)
    monkeypatch.setattr(peers, "_round", recorded)
    out = tmp_path / "peers.json"
    assert main([*ARGS, "--rounds", "3", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    ours, twin = report["rounds"][peers.Ours.name], report["rounds"][Twin.name]
    assert order == [peers.Ours.name, "twin", "twin", peers.Ours.name, peers.Ours.name, "twin"]
    for phase in peers.PHASES:
        assert report["ours_vs_peer"][phase] == _spread([a[phase] / b[phase] for a, b in zip(ours, twin)])
    for r, limits in enumerate(report["round_limits"]):  # a round's limit: the best measured in it, by either
        assert limits["memcpy"]["gbps"] == max(ours[r]["memcpy"]["gbps"], twin[r]["memcpy"]["gbps"])


def test_a_figure_above_its_rounds_limit_is_flagged_in_the_output_and_the_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(peers, "memcpy_limit", lambda pairs: Limit(1e-6, "too low", {"too low": 1e-6}))
    out = tmp_path / "peers.json"
    assert main([*ARGS, "--peer", "none", "--rounds", "2", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    flags = json.loads(out.read_text())["over_limit"]
    for phase in ("put", "host get"):
        assert sorted(f["round"] for f in flags if f["figure"] == f"{peers.Ours.name} {phase}") == [0, 1]
    assert capsys.readouterr().out.count("OVER LIMIT round ") == len(flags)


def test_a_missing_lmcache_is_a_usage_error_that_says_how_to_install_it(monkeypatch, capsys):
    import builtins
    real = builtins.__import__

    def no_lmcache(name, *a, **k):
        if name == "lmcache":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_lmcache)
    assert main(["peers", "--chunks", "2"]) == 2
    assert "pip install lmcache==0.5.6" in capsys.readouterr().err


def test_a_rounds_memcpy_limit_is_the_best_of_before_and_after_the_host_get_and_at_the_end(tmp_path, monkeypatch):
    """Memory's speed drifts within a round: a limit taken only at its end (after the cold get)
    was once beaten by 24% by the host get it was held against, and one taken after the host
    get and at the end by 5.8% (2026-12-05)."""
    # ours in round 0 (before the host get, after it, at the end), then in round 1
    taken = iter([35.0, 30.0, 20.0, 25.0, 15.0, 40.0])
    monkeypatch.setattr(peers, "memcpy_limit", lambda pairs: Limit(g := next(taken), "copy", {"copy": g}))
    out = tmp_path / "peers.json"
    assert main([*ARGS, "--peer", "none", "--rounds", "2", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    assert [limits["memcpy"]["gbps"] for limits in json.loads(out.read_text())["round_limits"]] == [35.0, 40.0]


def test_each_systems_get_from_host_ram_is_timed_as_often_as_the_memcpy_limits_configurations(tmp_path, monkeypatch):
    """Ours and the peer's alike: the best of REPEAT timings, as each memcpy configuration is."""
    from bench import limits

    gets = []

    def best_time(fn, repeat=limits.REPEAT):
        gets.append(repeat)
        return limits.best_time(fn, repeat)

    monkeypatch.setattr(peers, "_peer", lambda name: Twin)
    monkeypatch.setattr(peers, "best_time", best_time)
    assert main([*ARGS, "--rounds", "2", "--dir", str(tmp_path / "d")]) == 0
    assert gets == [limits.REPEAT] * 4  # two systems, two rounds
