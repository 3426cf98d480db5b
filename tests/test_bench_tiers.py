import json

from bench.cli import main


def test_kvbench_tiers_writes_the_documented_json(tmp_path):
    out = tmp_path / "tiers.json"
    rc = main(["tiers", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--tokens", "256",
               "--chunks", "4", "--repeat", "1", "--dir", str(tmp_path / "d"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert set(report["tiers"]) == {"host", "disk"}
    assert report["tiers"]["host"]["limit"] == "memcpy"
    assert report["tiers"]["disk"]["limit"] == "raw_read"
    for r in report["tiers"].values():
        assert {"put_gbps", "get_gbps", "limit_gbps"} <= set(r)
        assert all(r[k] > 0 for k in ("put_gbps", "get_gbps", "limit_gbps"))
    assert report["store"]["cold_disk_get_gbps"] > 0
    store = report["store"]  # every put of the burst timed: its median and P99 beside the throughput
    assert len(store["put_ms"]) == 4 and 0 < store["put_p50_ms"] <= store["put_p99_ms"] <= max(store["put_ms"])
    assert report["store"]["cold_get_limit"]["gbps"] >= report["tiers"]["disk"]["limit_gbps"]


def test_kvbench_usage_error_exits_2(capsys):
    assert main(["tiers", "--chunks", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err


def test_a_tiers_limit_is_measured_in_turns_with_ours(monkeypatch):
    """Each of ours is next to a measurement of the limit, the order alternating, and the
    limit is the best over all of them: a disk that slows during the run cannot leave the
    limit below ours because it was only measured after."""
    from bench import tiers
    from bench.limits import Limit

    calls = []
    speeds = iter([4.0, 1.0, 2.0])

    def ours():
        calls.append("ours")
        return 1.0

    def limit():
        calls.append("limit")
        gbps = next(speeds)
        return Limit(gbps, "x", {"x": gbps})

    seconds, best = tiers._interleaved(ours, limit, 3)
    assert calls == ["ours", "limit", "limit", "ours", "ours", "limit"]
    assert seconds == 1.0 and best.gbps == 4.0
