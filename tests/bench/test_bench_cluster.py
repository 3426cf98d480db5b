"""``kvbench cluster`` at N = 1 on tiny work: real daemons, a real Redis Cluster, the
documented JSON (figures are not asserted: they are the benchmark's to report)."""

import json

import pytest

from bench.cli import main
from bench.redis_local import REDIS_CLI, REDIS_SERVER

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")


@pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None, reason="redis-server/redis-cli not installed")
def test_kvbench_cluster_writes_the_documented_json(tmp_path, capsys):
    out = tmp_path / "cluster.json"
    assert main(["cluster", "--nodes", "1", "--prefixes", "2", "--prefix-chunks", "2", "--layers", "2",
                 "--rounds", "1", "--dir", str(tmp_path / "work"), "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("N=1: ours ")
    node = json.loads(out.read_text())["nodes"]["1"]
    assert set(node["single_gbps"]) == {"disk", "pfs", "redis"}
    assert node["sum_of_tiers_gbps"] == pytest.approx(sum(node["single_gbps"].values()))
    assert min(node["ours_gbps"], node["local_only_gbps"]) > 0
    assert set(node["burst_ttft_mean_s"]) == {"ours", "local_only", "local_only_own_prefixes"}
    assert node["conditions"]["hold"] in (True, False) and node["conditions"]["why"]
    for burst in node["bursts"].values():
        # shares of the cores only: on a burst this short (milliseconds) the kernel's 10 ms
        # ticks leave the two readings too coarse to compare with each other
        assert 0 <= burst["cpu"]["ours"] <= 1 and 0 <= burst["cpu"]["machine_busy"] <= 1
        assert burst["cpu"]["core_s_per_gb"] >= 0


def test_bad_arguments_are_usage_errors(capsys):
    assert main(["cluster", "--nodes", "0"]) == 2
    assert main(["cluster", "--nodes", "two"]) == 2
    assert main(["cluster", "--emulate", "disk=1MB/s"]) == 2
    assert "--emulate must cap disk, pfs and redis" in capsys.readouterr().err
