"""The cluster model (bench/cluster_model.py) against cases worked out by hand, properties
over random workloads, and ``kvbench cluster-sim`` end to end on tiny sizes."""

import json
import math

import pytest
from hypothesis import given, settings, strategies as st

from bench.cli import main
from bench.cluster_model import ClusterSpec, Request, copy_requests, simulate, summary, workload
from bench.cluster_sim import validate

MB = 1 << 20


def spec(nodes=1, disk=100e6, pfs=100e6, redis=100e6, pfs_total=0.0, redis_total=0.0, prefill=math.inf):
    return ClusterSpec(nodes=nodes, chunk_bytes=MB, chunk_tokens=256, prefill_tokens_per_s=prefill, disk_bps=disk,
                       pfs_link_bps=pfs, pfs_aggregate_bps=pfs_total, redis_link_bps=redis, redis_aggregate_bps=redis_total)


def test_one_tier_serves_the_earliest_requests_in_turn():
    s = spec()
    burst = [Request(0.0, 0, 10, 0, 0) for _ in range(3)]
    s.window = 0  # all in turn: processor sharing
    assert [r.ttft for r in simulate(s, copy_requests(burst), "local_only")] == [
        pytest.approx(28 * MB / 100e6), pytest.approx(29 * MB / 100e6), pytest.approx(30 * MB / 100e6)]
    s.window = 1  # earliest first
    assert [r.ttft for r in simulate(s, copy_requests(burst), "local_only")] == [
        pytest.approx(10 * MB / 100e6), pytest.approx(20 * MB / 100e6), pytest.approx(30 * MB / 100e6)]
    s.window = 2  # the two earliest in turn; the third joins when the first ends
    assert [r.ttft for r in simulate(s, copy_requests(burst), "local_only")] == [
        pytest.approx(19 * MB / 100e6), pytest.approx(29 * MB / 100e6), pytest.approx(30 * MB / 100e6)]


def test_free_tier_fetching_sums_the_tiers():
    s = spec(disk=100e6, pfs=200e6, redis=50e6)
    (r,) = simulate(s, [Request(0.0, 0, 700, 0, 0)], "ours")  # one request: any window
    assert r.ttft == pytest.approx(700 * MB / 350e6, rel=0.01)
    assert r.tiers_used == {"disk": pytest.approx(200, abs=2), "pfs": pytest.approx(400, abs=2),
                            "redis": pytest.approx(100, abs=2)}


def test_another_nodes_prefix_is_recomputed_by_local_only_and_loaded_from_shared_tiers_by_ours():
    s = spec(nodes=2, prefill=256 * 10.0)  # a chunk's tokens in 0.1 s
    request = [Request(0.0, 0, 8, 0, 1)]
    (local,) = simulate(s, copy_requests(request), "local_only")
    (ours,) = simulate(s, copy_requests(request), "ours")
    assert local.ttft == pytest.approx(0.8 + 1 / 2560)  # every chunk, then the last token
    assert "disk" not in ours.tiers_used  # node 1's disk is not node 0's
    assert ours.ttft == pytest.approx(8 * MB / 200e6 + 1 / 2560, rel=0.01)


def test_the_gpu_takes_requests_in_turn():
    s = spec(prefill=1000.0)
    out = simulate(s, [Request(0.0, 0, 0, 500, None), Request(0.0, 0, 0, 1000, None)], "ours")
    assert [r.ttft for r in out] == [pytest.approx(0.5), pytest.approx(1.5)]


def test_a_shared_tier_is_split_between_nodes_under_its_aggregate():
    s = spec(nodes=4, pfs=100e6, pfs_total=200e6)
    s.shared = ("pfs",)
    burst = [Request(0.0, n, 50, 0, (n + 1) % 4) for n in range(4)]
    result = summary(simulate(s, burst, "ours"))
    assert 4 * 50 * MB / result["makespan_s"] == pytest.approx(200e6, rel=0.02)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.one_of(st.just(0.0), st.floats(0.01, 20.0)), st.integers(1, 12), st.floats(0.0, 1.0), st.integers(0, 1000))
def test_no_node_reads_faster_than_its_tiers_and_every_chunk_lands_once(nodes, load, per_node, host_hit, seed):
    s = ClusterSpec(nodes=nodes, chunk_bytes=MB, chunk_tokens=16, prefill_tokens_per_s=50000.0, host_bps=400e6,
                    disk_bps=100e6, pfs_link_bps=80e6, pfs_aggregate_bps=150e6, redis_link_bps=60e6, redis_aggregate_bps=0)
    requests = workload(s, per_node, load, (1, 6), 16, 0.8, None, host_hit, seed)
    for system in ("ours", "local_only"):
        out = simulate(s, copy_requests(requests), system)
        for r in out:
            assert r.ttft > 0
            loaded = sum(r.tiers_used.values())
            assert loaded in (0, r.chunks)
            if loaded:
                fastest = 400e6 if r.in_host else 100e6 + 80e6 + 60e6
                assert r.load_done - r.arrival >= r.chunks * MB / fastest * (1 - 1e-9)


def test_validation_recovers_a_cluster_that_behaves_like_the_model():
    s = spec(nodes=2, disk=100e6, pfs=100e6, redis=50e6)
    burst = [Request(0.0, n, 16, 0, (n + 1) % 2) for n in range(2) for _ in range(4)]
    ours = summary(simulate(s, burst, "ours"))
    own = summary(simulate(s, [Request(0.0, n, 16, 0, n) for n in range(2) for _ in range(4)], "local_only"))
    total = 2 * 4 * 16 * MB
    report = {"chunk_bytes": MB, "prefixes_per_node": 4, "prefix_chunks": 16, "nodes": {"2": {
        "single_gbps": {"pfs": 0.2, "redis": 0.1}, "local_only_gbps": 0.2, "ours_gbps": total / ours["makespan_s"] / 1e9,
        "burst_ttft_mean_s": {"ours": ours["ttft_mean_s"], "local_only_own_prefixes": own["ttft_mean_s"]}}}}
    errors = validate(report)["2"]["error"]
    assert all(abs(e) < 1e-6 for e in errors.values()), errors


def test_validation_flags_a_run_whose_cores_were_saturated():
    node = {"single_gbps": {"pfs": 0.2, "redis": 0.1}, "local_only_gbps": 0.2, "ours_gbps": 0.2,
            "burst_ttft_mean_s": {"ours": 0.5, "local_only_own_prefixes": 1.0}}
    report = {"chunk_bytes": MB, "prefixes_per_node": 4, "prefix_chunks": 16, "nodes": {
        "1": {**node, "conditions": {"hold": True, "why": "the cores stayed under 90% busy"}},
        "2": {**node, "conditions": {"hold": False, "why": "CPU-bound: the cores were 100% busy"}},
        "4": node}}
    checked = validate(report)
    assert checked["1"]["covered"] is True
    assert checked["2"]["covered"] is False and "CPU-bound" in checked["2"]["why"]
    assert checked["4"]["covered"] is None and "unknown" in checked["4"]["why"]


def test_kvbench_cluster_sim_end_to_end(tmp_path):
    out = tmp_path / "sim.json"
    png = tmp_path / "sim.png"
    assert main(["cluster-sim", "--nodes", "1,4", "--loads", "0.5,4", "--requests", "24", "--prefix-chunks", "2,6",
                 "--host-hits", "0,1", "--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())["sweep"]
    assert set(report["curves"]) == {"1", "4"} and set(report["curves"]["4"]) == {"0.5", "4.0"}
    point = report["curves"]["4"]["4.0"]
    assert point["ttft_gain"] == pytest.approx(point["local_only"]["ttft_mean_s"] / point["ours"]["ttft_mean_s"])
    assert report["host_hit_at"]["points"]["1.0"]["ttft_gain"] == pytest.approx(1.0)  # all in host RAM: no gain
    assert png.stat().st_size > 0
