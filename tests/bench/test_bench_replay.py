import json

import pytest
import torch

from bench.cli import main
from bench.replay import DEFAULT_VERDICTS


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


def test_modelled_time_counts_bytes_at_the_tiers_bandwidth_and_misses_at_the_prefill_rate(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1\n1\n")  # a miss, then a host RAM hit
    out = tmp_path / "replay.json"
    assert main(["replay", "--trace", str(trace), "--policies", "lru", "--layers", "1", "--head-dim", "16",
                 "--tokens", "16", "--prefill-tok-s", "1000", "--read-gbps", "host=0.001,disk=0.001",
                 "--model-kv-bytes-per-token", "2048", "--model-tokens", "64", "--dir", str(tmp_path / "d"),
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    r = report["policies"]["lru"]
    assert report["time_model"]["recompute_s_per_block"] == pytest.approx(0.064)
    # the hit reads one blob (header + 1 KiB raw) of a chunk standing for 64 x 2 KiB at 1 MB/s
    hit_s = r["bytes_read"]["host"] * (64 * 2048 / 1024) / 1e6
    assert r["bytes_read"]["host"] > 1024
    assert r["ttft"]["mean_s"] == pytest.approx((0.064 + hit_s) / 2)


def test_fixed_ratio_compression_serves_every_hit_lossy_and_bounds_the_quality_change(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1 2\n1 2\n")
    out = tmp_path / "replay.json"
    assert main(["replay", "--trace", str(trace), "--policies", "lru+int8", "--layers", "1", "--head-dim", "16",
                 "--tokens", "16", "--read-gbps", "host=10,disk=1", "--decode-gbps", "5",
                 "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())["policies"]["lru+int8"]
    assert r["lossy_hit_pct"] == r["total_hit_pct"] == 50
    int8 = json.loads(open(DEFAULT_VERDICTS).read())["codecs"]["int8"]["ppl_change_pct"]
    assert r["ppl_change_bound_pct"] == pytest.approx(0.5 * int8)


@pytest.mark.parametrize("policies, message", [("lru+zstd", "after '+'"), ("lru+int8+int4", "after '+'"),
                                                ("mru+compress", "unknown policies")])
def test_replay_rejects_unknown_variants(tmp_path, capsys, policies, message):
    trace = tmp_path / "trace.txt"
    trace.write_text("1 2\n")
    assert main(["replay", "--trace", str(trace), "--policies", policies]) == 2
    assert message in capsys.readouterr().err


def test_real_payloads_are_the_models_kv(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("1 2\n1 3\n")
    out = tmp_path / "replay.json"
    assert main(["replay", "--trace", str(trace), "--policies", "lru", "--payloads", "real", "--tokens", "16",
                 "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["chunk_shape"] == [30, 2, 16, 3, 64]  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    assert report["policies"]["lru"]["total_hit_pct"] == 25


def test_the_floor_is_an_unbounded_cache_that_loads_in_no_time():
    from bench.replay import floor

    f = floor([[1, 2, 3], [1, 2, 4], [5, 1, 2]], recompute_s=0.5)
    assert f["hit_pct"] == pytest.approx(100 * 2 / 9)  # block 1 and 2 again in request 2; request 3 starts new
    assert f["ttft_mean_s"] == pytest.approx((1.5 + 0.5 + 1.5) / 3)


def test_the_measured_decode_speed_is_per_byte_whatever_model_the_bytes_stand_for(monkeypatch):
    """A block standing for 100x the bytes takes 100x as long to decode (it once took as long)."""
    import argparse

    import bench.replay
    from bench.replay import time_model

    monkeypatch.setattr(bench.replay, "int8_decode_bytes_per_s", lambda chunk: 4e9)

    chunk = torch.randn(2, 2, 16, 1, 64).half()
    args = argparse.Namespace(read_gbps="host=1", decode_gbps=None, model_tokens=None, prefill_tok_s=1000.0,
                              model_kv_bytes_per_token=None)
    small = time_model(args, chunk)
    args.model_kv_bytes_per_token = 100 * chunk[:, :, :1].numel() * 2
    large = time_model(args, chunk)
    assert large.scale == pytest.approx(100 * small.scale)
    assert small.decode_bytes_per_s == pytest.approx(4e9 / small.scale)
    assert small.decode_bytes_per_s / large.decode_bytes_per_s == pytest.approx(100)


def test_replay_with_a_pfs_and_planned_replication(tmp_path):
    trace = tmp_path / "trace.txt"
    trace.write_text("".join(f"{i}\n" for i in range(12)) * 3)
    out = tmp_path / "replay.json"
    assert main(["replay", "--trace", str(trace), "--policies", "lru,lru+replicate", "--layers", "1", "--head-dim",
                 "16", "--tokens", "16", "--host-pct", "10", "--disk-pct", "40", "--pfs-pct", "40",
                 "--read-gbps", "host=10,disk=1,pfs=2", "--dir", str(tmp_path / "d"), "--json", str(out)]) == 0
    plain, planned = (json.loads(out.read_text())["policies"][p] for p in ("lru", "lru+replicate"))
    # every chunk in both tiers holds 4 of 12 below host RAM; one copy each, 8
    assert plain["hit_pct"]["pfs"] + plain["hit_pct"]["disk"] < planned["hit_pct"]["pfs"] + planned["hit_pct"]["disk"]
