"""``kvbench connector --quick``: every source (host RAM, disk in a new process with a cold
page cache, the daemon over shm and remote) yields a full-prefix hit, real-text prompts load
all but their last partial block with outputs equal to cold, and the JSON holds the schema
other tools read."""

import json

from bench.cli import main as kvbench

SOURCES = {"host", "disk", "shm", "remote"}


def test_quick_run_writes_the_documented_schema(tmp_path, capsys):
    out = tmp_path / "connector.json"
    assert kvbench(["connector", "--quick", "--threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert set(r["ttft"]) == {"64", "128"}
    for length, t in r["ttft"].items():
        assert t["cold_s"] > 0 and set(t["hit_s"]) == SOURCES and set(t["load_gbps"]) == SOURCES
        assert all(v > 0 for v in t["hit_s"].values()) and all(v > 0 for v in t["load_gbps"].values())
        for run in t["runs"].values():  # a full-prefix hit: all loaded, the last token computed
            assert (run["loaded_tokens"], run["computed_tokens"]) == (int(length), 1)
        assert t["runs"]["disk"]["disk_chunk_reads"] == int(length) // r["chunk_tokens"]
    assert r["memcpy_gbps"] > 0 and r["raw_read_gbps"] > 0
    for name in ("with_store", "without_store"):
        assert r["multi_turn"][name]["ttft_mean_s"] > 0 and r["multi_turn"][name]["ttft_p90_s"] > 0
    assert r["multi_turn"]["with_store"]["loaded_tokens"] > 0
    assert set(r["checks"]["hit_vs_cold_at_2k"]) == SOURCES
    text = r["real_text"]
    assert len(text["prompts"]) == 6 and set(text["summary"]) == {"host", "shm"}
    for p in text["prompts"].values():  # a prompt's tail of whole 16-token blocks loads too
        assert p["loaded_tokens"] == {"host": p["tokens"] // 16 * 16, "shm": p["tokens"] // 16 * 16}
        assert all(0 < p["hit_vs_cold"][s] for s in ("host", "shm"))
    assert 0 < r["checks"]["real_text_hit_vs_cold"]["host"]
    assert "multi-turn" in capsys.readouterr().out
