"""``kvbench agents`` on a tiny random checkpoint: every mode serves every session with the same
greedy tokens, the JSON holds the documented keys, the PNG is written, and agent traces
round-trip through the documented JSONL format (bad lines are one clear error)."""

import json

import pytest

from bench.agent_trace import AgentSession, Turn, dump_jsonl, load_jsonl, synthetic
from bench.cli import main as kvbench
from engine.testing import make_tiny_checkpoint

MODES = ("recompute", "keep", "events", "predict")
SMALL = ["--sessions", "3", "--turns", "3", "--system-tokens", "16", "--task-tokens", "40", "--tool-tokens", "12",
         "--output-tokens", "4", "--stall-median-s", "0.05", "--stall-max-s", "0.2", "--arrival-gap-s", "0.02",
         "--kv-tokens", "160", "--block-size", "4", "--chunk-tokens", "16", "--host-mb", "16", "--threads", "1"]


def test_every_mode_serves_every_session_with_the_same_tokens(tmp_path, capsys):
    model = make_tiny_checkpoint(tmp_path / "tiny", "llama")
    out, png, trace = tmp_path / "agents.json", tmp_path / "agents.png", tmp_path / "trace.jsonl"
    assert kvbench(["agents", "--model", str(model), *SMALL, "--json", str(out), "--plot", str(png),
                    "--save-trace", str(trace)]) == 0
    r = json.loads(out.read_text())
    assert set(r["modes"]) == set(MODES)
    for name, m in r["modes"].items():
        assert m["sessions_served"] == 3 and m["outputs_match"], name
        assert m["e2e_mean_s"] > 0 and m["e2e_p90_s"] >= m["e2e_p50_s"]
        assert len(m["e2e_s"]) == 3 and len(m["resumed_ttft_s"]) == 6
        assert 0 < m["occupancy_mean"] <= 1 and m["sessions_in_flight_max"] >= 1
        assert m["sessions_retained_max"] <= m["sessions_in_flight_max"] and 0 <= m["warm_resumes"] <= 1
    assert r["modes"]["events"]["loaded_tokens"] > 0
    assert r["modes"]["recompute"]["loaded_tokens"] == 0
    assert png.stat().st_size > 0
    assert "events" in capsys.readouterr().out
    # the saved trace replays
    assert kvbench(["agents", "--model", str(model), *SMALL, "--trace", str(trace), "--modes", "events",
                    "--json", str(out)]) == 0
    assert json.loads(out.read_text())["modes"]["events"]["sessions_served"] == 3


def test_traces_round_trip_and_bad_lines_are_named(tmp_path):
    sessions = synthetic(4, 3, 64, 16, 8, 1.0, 1.0, 5.0, 0.5, seed=1)
    assert all(s.turns[-1].stall_s == 0 and all(t.stall_s > 0 for t in s.turns[:-1]) for s in sessions)
    sessions.append(AgentSession("x", 1.0, [Turn(input="tool said hi", output_tokens=2, tool="code", stall_s=0.5,
                                                 expected_s=0.4), Turn(output_tokens=1)], critical=True))
    path = tmp_path / "t.jsonl"
    dump_jsonl(sessions, path)
    assert load_jsonl(path) == sessions
    path.write_text('{"session": "a", "turns": [{"output_tokens": 0}]}\n')
    with pytest.raises(ValueError, match="t.jsonl:1"):
        load_jsonl(path)
    path.write_text('{"session": "a"}\n')
    with pytest.raises(ValueError, match="t.jsonl:1: not an agent session"):
        load_jsonl(path)


def test_unknown_modes_are_refused(capsys):
    assert kvbench(["agents", "--modes", "events,magic"]) == 2
    assert "unknown modes" in capsys.readouterr().err
