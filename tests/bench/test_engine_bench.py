"""``kvbench engine --quick`` runs end to end on a tiny random model and writes the promised JSON."""

import json

import torch

from bench.cli import main


def test_kvbench_engine_quick(tmp_path):
    out = tmp_path / "engine.json"
    old = torch.get_num_threads()
    try:
        assert main(["engine", "--quick", "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(old)
    r = json.loads(out.read_text())
    assert r["continuous_tok_s"] > 0 and r["static_tok_s"] > 0
    assert set(r["ours_tok_s"]) == set(r["hf_tok_s"]) == {"1", "8"}
    assert set(r["policies"]) == {"fcfs", "spf", "qba"}
    for p in r["policies"].values():
        assert 0 <= p["ttft_p50_s"] <= p["ttft_p99_s"]


def test_kvbench_engine_missing_trace_is_a_usage_error(tmp_path, capsys):
    assert main(["engine", "--quick", "--trace", str(tmp_path / "none.csv.gz")]) == 2
    assert "not found" in capsys.readouterr().err
