import json
import statistics

from bench.cli import main
from bench.limits import Limit

ARGS = ["tiers", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--tokens", "256", "--chunks", "4"]


def _is_spread_of(section: dict, key: str, values: list[float]) -> None:
    """The printed figure is the median of the rounds', with their smallest and largest."""
    assert section["spread"][key] == {"median": statistics.median(values), "min": min(values), "max": max(values)}
    assert section[key] == statistics.median(values)


def test_kvbench_tiers_reports_medians_of_rounds_and_keeps_every_round(tmp_path, capsys):
    out = tmp_path / "tiers.json"
    assert main([*ARGS, "--rounds", "3", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    rounds = report["rounds"]
    assert len(rounds) == 3
    assert set(report["tiers"]) == {"host", "disk"}
    host, disk, store = report["tiers"]["host"], report["tiers"]["disk"], report["store"]
    assert host["limit"] == "memcpy" and disk["limit"] == "raw_read"
    for name, section in (("host", host), ("disk", disk)):
        for key in ("put_gbps", "get_gbps"):
            _is_spread_of(section, key, [r[name][key] for r in rounds])
            assert section[key] > 0
        limits = [r[name]["get_limit"] for r in rounds]  # each round's limit: its best configuration
        assert all(limit["gbps"] == max(limit["tried"].values()) for limit in limits)
        _is_spread_of(section, "limit_gbps", [limit["gbps"] for limit in limits])
        _is_spread_of(section, "get_vs_limit", [r[name]["get_gbps"] / limit["gbps"] for r, limit in zip(rounds, limits)])
    _is_spread_of(host, "put_vs_limit", [r["host"]["put_gbps"] / r["host"]["put_limit"]["gbps"] for r in rounds])
    for key in ("put_gbps", "host_get_gbps", "cold_disk_get_gbps", "put_p50_ms", "put_p99_ms", "durable_put_gbps"):
        _is_spread_of(store, key, [r["store"][key] for r in rounds])
    _is_spread_of(store, "put_vs_memcpy", [r["store"]["put_gbps"] / r["host"]["put_limit"]["gbps"] for r in rounds])
    _is_spread_of(store, "cold_disk_get_vs_raw_read",
                  [r["store"]["cold_disk_get_gbps"] / r["store"]["cold_get_limit"]["gbps"] for r in rounds])
    for r in rounds:  # every put of every round's burst timed: its median and P99 beside the throughput
        s = r["store"]
        assert len(s["put_ms"]) == 4 and 0 < s["put_p50_ms"] <= s["put_p99_ms"] <= max(s["put_ms"])
        # the store's cold get is held against the best raw read of its round, its own files' or the tier's
        assert s["cold_get_limit"]["gbps"] == max(s["cold_get_own_files_limit"]["gbps"], r["disk"]["get_limit"]["gbps"])
    text = capsys.readouterr().out
    assert "3 rounds" in text and "median (min-max)" in text
    assert f"{host['spread']['get_gbps']['median']:.2f} ({host['spread']['get_gbps']['min']:.2f}-" in text
    assert isinstance(report["over_limit"], list)


def test_a_figure_above_its_rounds_limit_is_flagged_in_the_output_and_the_json(tmp_path, monkeypatch, capsys):
    """A limit that ours beats proves the limit wrong: every round in which it happened is named."""
    from bench import tiers

    monkeypatch.setattr(tiers, "memcpy_limit", lambda pairs: Limit(1e-6, "too low", {"too low": 1e-6}))
    out = tmp_path / "tiers.json"
    assert main([*ARGS, "--rounds", "2", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    flags = json.loads(out.read_text())["over_limit"]
    for figure in ("host get", "host put", "store put", "store get from host"):
        assert sorted(f["round"] for f in flags if f["figure"] == figure) == [0, 1]
    assert {f["limit_config"] for f in flags if f["figure"].startswith("host")} == {"too low"}
    text = capsys.readouterr().out
    assert text.count("OVER LIMIT round ") == len(flags)


def test_kvbench_usage_error_exits_2(capsys):
    assert main(["tiers", "--chunks", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert main(["tiers", "--rounds", "0"]) == 2


def test_the_host_gets_and_their_limit_write_a_destination_per_chunk(tmp_path, monkeypatch):
    """One destination reused for every chunk stayed in the last-level cache, and its memcpy
    limit ran at 46 GB/s where memory copies 12-26: a connector loads a prompt's chunks into
    blocks of a paged cache far larger than any cache. The limit copies into the very
    destinations the gets fill."""
    from bench import tiers

    copied_into = []
    real = tiers.memcpy_limit

    def recorded(pairs):
        pairs = list(pairs)
        copied_into.append({dst.__array_interface__["data"][0] for dst, _ in pairs})
        return real(pairs)

    monkeypatch.setattr(tiers, "memcpy_limit", recorded)
    assert main([*ARGS, "--rounds", "1", "--dir", str(tmp_path / "d")]) == 0
    get_limit_destinations = copied_into[0]  # HostBench._limits: the get's, then the put's
    assert len(get_limit_destinations) == 4  # --chunks 4: one destination each


def test_the_host_limits_are_measured_before_and_after_ours_from_the_second_round(tmp_path, monkeypatch):
    """Once a round, a limit taken at a slow moment was beaten by more than 5% by a get of
    ours at a fast one (2026-12-05). Each round after the first measures both limits before
    its gets and puts and again after them (the first has no pages to copy before)."""
    from bench import tiers

    calls = []
    real = tiers.memcpy_limit
    monkeypatch.setattr(tiers, "memcpy_limit", lambda pairs: calls.append(1) or real(pairs))
    assert main([*ARGS, "--rounds", "2", "--dir", str(tmp_path / "d")]) == 0
    assert len(calls) == 2 + 4  # round 0: get and put limits after ours; round 1: before and after


def test_the_measurements_that_can_be_made_again_are_timed_as_often_as_a_limits_configurations(tmp_path, monkeypatch):
    """A limit is the best of REPEAT timings of each configuration; ours is too where it can be
    measured again (the host tier's put and get, the Store's get from host RAM): one timing of
    ours against the best of several would read a hiccup of the machine as ours being slow."""
    from bench import limits, tiers

    timed = []

    def best_time(fn, repeat=limits.REPEAT):
        timed.append((fn.__name__, repeat))
        return limits.best_time(fn, repeat)

    monkeypatch.setattr(tiers, "best_time", best_time)
    assert main([*ARGS, "--rounds", "1", "--dir", str(tmp_path / "d")]) == 0
    assert sorted(timed) == [("_get", limits.REPEAT), ("_host_get", limits.REPEAT), ("_put", limits.REPEAT)]
