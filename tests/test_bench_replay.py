import json

import pytest

from bench.cli import main


def test_replay_counts_prefix_hits_through_the_real_store(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1 2 3\n1 2 4\n1 2 3\n")
    out = tmp_path / "replay.json"
    rc = main(["replay", "--trace", str(trace), "--policies", "lru,default", "--layers", "1", "--head-dim", "16",
               "--tokens", "16", "--dir", str(tmp_path / "d"), "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 3 and set(report["policies"]) == {"lru", "default"}
    for r in report["policies"].values():
        # request 2 reuses blocks 1 and 2, request 3 blocks 1, 2 and 3: 5 of 9 accesses
        assert r["total_hit_pct"] == pytest.approx(500 / 9)
        assert r["ttft"]["p99_s"] >= r["ttft"]["p50_s"] > 0
        assert r["bytes_written"]["host"] > 0


def test_replay_reports_ttft_per_request_class(tmp_path, capsys):
    out = tmp_path / "replay.json"
    rc = main(["replay", "--trace", "workload:saas:requests=60", "--requests", "50", "--policies", "lru",
               "--layers", "1", "--head-dim", "16", "--tokens", "16", "--dir", str(tmp_path / "d"), "--json", str(out)])
    assert rc == 0
    by_class = json.loads(out.read_text())["policies"]["lru"]["by_class"]
    assert sum(v["requests"] for v in by_class.values()) == 50
    assert set(by_class) <= {"docqa", "chat", "agent", "batch", "oneoff"} and "chat" in by_class
    for v in by_class.values():
        assert 0 <= v["prefix_hit_pct"] <= 100 and v["ttft"]["p90_s"] >= v["ttft"]["p50_s"] > 0
    assert "per request class" in capsys.readouterr().out


def test_replay_of_an_unlabelled_trace_has_no_classes(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1 2\n1 3\n")
    out = tmp_path / "replay.json"
    assert main(["replay", "--trace", str(trace), "--policies", "lru", "--layers", "1", "--head-dim", "16",
                 "--tokens", "16", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["policies"]["lru"]["by_class"] == {}


def test_replay_rejects_unknown_policies(tmp_path, capsys):
    trace = tmp_path / "trace.txt"
    trace.write_text("1 2\n")
    assert main(["replay", "--trace", str(trace), "--policies", "belady-ish"]) == 2
    assert "unknown policies" in capsys.readouterr().err


def test_replay_with_joint_compression_keeps_more_chunks_than_fit_raw(tmp_path):
    trace = tmp_path / "trace.txt"
    # six one-block prompts in a loop: LRU on 4 raw chunks per tier never hits; compressed, 6 fit
    trace.write_text("".join(f"{i}\n" for i in range(6)) * 5)
    out = tmp_path / "replay.json"
    rc = main(["replay", "--trace", str(trace), "--policies", "lru,lru+compress", "--dir", str(tmp_path / "d"),
               "--json", str(out)])
    assert rc == 0
    plain, compressed = (json.loads(out.read_text())["policies"][p] for p in ("lru", "lru+compress"))
    assert plain["lossy_hit_pct"] == 0 and sum(plain["recodes"].values()) == 0
    assert plain["total_hit_pct"] == 0
    assert compressed["recodes"]["disk"] > 0 and compressed["total_hit_pct"] > 0
    assert compressed["lossy_hit_pct"] > 0
