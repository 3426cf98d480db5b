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


def test_kvbench_usage_error_exits_2(capsys):
    assert main(["tiers", "--chunks", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
