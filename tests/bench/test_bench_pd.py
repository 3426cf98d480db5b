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
    captured = capsys.readouterr()
    assert "raw TTFT / colocated" in captured.out
    assert "engines started: 5/5 (100%)" in captured.err  # the minute the engines load is not silent


def _run(transfer_bytes, ppl=0.0, stream=1.0, exact=1.0, needle_same=True):
    return {"ttft_mean_s": 1.0, "ttft_s": [1.0], "tpot_mean_s": 0.1, "second_token_mean_s": 0.1,
            "tpot_decode_mean_s": 0.1, "transfer_bytes": transfer_bytes, "put_s": 0.0, "load_s": 0.0,
            "ppl_change_pct": ppl, "exact_match": exact, "token_match": exact, "stream_exact_match_vs_raw": stream,
            "needle": {"128": True}, "needle_text_equals_raw": needle_same}


def test_a_codec_that_changed_an_output_is_never_the_best():
    """mixed25 cuts the most bytes within 2% perplexity but changed outputs (one each way the
    benchmark compares): the best is the codec whose outputs all equal raw's, and the table
    names the others as not candidates."""
    from bench.pd_verdict import checks, format_table

    for changed in ({"stream": 0.75}, {"exact": 0.5}, {"needle_same": False}):
        runs = {"colocated": _run(0), "raw": _run(1000), "mixed25": _run(250, ppl=0.09, **changed),
                "int8": _run(400, ppl=0.02)}
        c = checks(runs)
        assert c["best_codec"] == "int8" and c["best_bytes_cut"] == 2.5 and c["changed_outputs"] == ["mixed25"]
        table = format_table({"model": "m", "link_gbps": 1.0, "chunk_tokens": 32, "kv_bytes_per_token": 1,
                              "requests": [{"prompt_tokens": 64, "output_tokens": 4}], "runs": runs, "checks": c})
        assert "every output equal to raw: int8" in table and "changed an output" in table and "mixed25" in table
    c = checks({"colocated": _run(0), "raw": _run(1000), "mixed25": _run(250, stream=0.5)})
    assert "best_codec" not in c and c["changed_outputs"] == ["mixed25"]
