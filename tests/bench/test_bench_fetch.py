import json

from bench.cli import main


def test_kvbench_fetch_emulated_writes_documented_json(tmp_path, capsys):
    out = tmp_path / "fetch.json"
    rc = main(["fetch", "--chunks", "8", "--layers", "2", "--kv-heads", "1", "--head-dim", "64", "--tokens", "256",
               "--emulate", "20MB/s,30MB/s", "--repeat", "1", "--json", str(out)])
    assert rc == 0
    assert "emulated read caps: disk 20 MB/s, pfs 30 MB/s" in capsys.readouterr().out  # not a dict
    r = json.loads(out.read_text())
    assert set(r["single_gbps"]) == {"disk", "pfs"}
    assert r["aggregate_gbps"] > 0
    assert abs(r["ratio"] - r["aggregate_gbps"] / sum(r["single_gbps"].values())) < 1e-9
    assert abs(sum(r["share_of_chunks"].values()) - 1) < 1e-9


def test_bad_emulate_is_a_usage_error(capsys):
    assert main(["fetch", "--emulate", "fast"]) == 2
    assert main(["fetch", "--emulate", "1MB/s,1MB/s,1MB/s"]) == 2
