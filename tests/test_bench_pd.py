"""``kvbench pd --quick``: colocated, disaggregated raw and a mixed-precision transfer through
real engine and daemon processes; the JSON holds the keys the issue names, the link carries
the promised chunks (raw in full, mixed50 in half), and raw's outputs equal colocated ones."""

import json

from bench.cli import main as kvbench


def test_quick_run_writes_the_documented_schema(tmp_path, capsys):
    out = tmp_path / "pd.json"
    assert kvbench(["pd", "--quick", "--codecs", "mixed50", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["link_gbps"] == 1.0 and set(r["runs"]) == {"colocated", "raw", "mixed50"}
    for run in r["runs"].values():
        assert {"ttft_mean_s", "tpot_mean_s", "transfer_bytes", "ppl_change_pct"} <= set(run)
        assert run["ttft_mean_s"] > 0
    raw, mixed = r["runs"]["raw"], r["runs"]["mixed50"]
    chunk_bytes = r["kv_bytes_per_token"] * r["chunk_tokens"]
    assert raw["promised_tokens"] == raw["loaded_tokens"] > 0 and raw["rerouted"] == raw["wait_timeouts"] == 0
    assert raw["transfer_bytes"] >= raw["promised_tokens"] // r["chunk_tokens"] * chunk_bytes
    assert raw["link_read_bytes"] >= raw["transfer_bytes"] * 0.99  # the decode node read them over the link
    assert 1.9 < raw["transfer_bytes"] / mixed["transfer_bytes"] <= 2.0
    assert raw["ppl_change_pct"] == 0 and raw["stream_exact_match_vs_raw"] == 1
    assert r["runs"]["colocated"]["stream_exact_match_vs_raw"] == 1  # disaggregated raw = colocated
    assert mixed["quality_loaded_tokens"] > 0 and set(mixed["needle"]) == {"128"}
    assert "raw TTFT / colocated" in capsys.readouterr().out
