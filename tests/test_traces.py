"""Trace formats, the synthetic workload generator and the ``kvbench policies`` command."""

import gzip
import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.sim import capacity_blocks, simulate
from bench.synthetic import SyntheticSpec, generate, parse_spec
from bench.traces import load_trace
from kvstore.policies import make_policy

MOONCAKE = Path("/work/shared/traces/mooncake_conversation_trace.jsonl.gz")


def test_text_and_jsonl_formats_gzipped_or_not(tmp_path):
    text = "# a comment\n1 2 3\n\n1 2 4\n7\n"
    jsonl = "".join(json.dumps({"timestamp": 0, "hash_ids": ids}) + "\n" for ids in ([1, 2, 3], [1, 2, 4], [7]))
    paths = {"t.txt": text, "t.jsonl": jsonl}
    for name, content in list(paths.items()):
        (tmp_path / name).write_text(content)
        with gzip.open(tmp_path / (name + ".bin"), "wt") as f:  # gzip is detected by content, not name
            f.write(content)
    for name in ("t.txt", "t.jsonl", "t.txt.bin", "t.jsonl.bin"):
        trace = load_trace(str(tmp_path / name))
        assert trace.requests == [[1, 2, 3], [1, 2, 4], [7]]
        assert (trace.distinct, trace.accesses) == (5, 7)


def test_bad_traces_are_value_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"hash_ids": [1]}\n{"input_length": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_trace(str(tmp_path / "bad.jsonl"))
    (tmp_path / "empty.txt").write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="no requests"):
        load_trace(str(tmp_path / "empty.txt"))
    with pytest.raises(FileNotFoundError):
        load_trace(str(tmp_path / "missing.txt"))


@pytest.mark.skipif(not MOONCAKE.exists(), reason="Mooncake trace not present")
def test_mooncake_trace_figures_from_its_readme():
    trace = load_trace(str(MOONCAKE))
    assert (len(trace.requests), trace.accesses, trace.distinct) == (12031, 288500, 182790)


def test_synthetic_is_deterministic_and_prefix_consistent():
    spec = SyntheticSpec(requests=400, seed=5)
    a, b = generate(spec), generate(spec)
    assert a == b and a != generate(SyntheticSpec(requests=400, seed=6))
    parent_of = {}
    for request in a:
        for parent, key in zip([None, *request], request):
            assert parent_of.setdefault(key, parent) == parent  # an id names its whole prefix
    assert parse_spec("synthetic:requests=10,zipf=0.8") == SyntheticSpec(requests=10, zipf=0.8)
    with pytest.raises(ValueError):
        parse_spec("synthetic:nope=1")


def test_default_policy_never_below_lru_on_unseen_synthetic_workloads():
    """The default policy's claim, on workloads it was not tuned on (small, for speed)."""
    for spec in ("synthetic:requests=2500,seed=11", "synthetic:requests=2500,seed=12,docs=300,zipf=1.3,conv_share=0.2"):
        trace = load_trace(spec)
        for pct in (1, 2, 5, 10, 20):
            blocks = capacity_blocks(trace, pct)
            ours = simulate(trace, make_policy("default", blocks), blocks).prefix_hits
            lru = simulate(trace, make_policy("lru", blocks), blocks).prefix_hits
            assert ours >= lru, (spec, pct)


def test_policies_command_json(tmp_path, capsys):
    trace = tmp_path / "t.txt"
    trace.write_text("\n".join(" ".join(map(str, range(i % 7, i % 7 + 5))) for i in range(200)))
    out = tmp_path / "r.json"
    rc = main(["policies", "--trace", str(trace), "--capacities", "10,50", "--policies", "lru,default,opt", "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["capacities"] == [10, 50]
    assert set(result["policies"]) == {"lru", "shadow-vote", "opt"}
    for figures in result["policies"].values():
        assert len(figures["hit"]) == len(figures["prefix_hit"]) == 2
        assert all(0 <= p <= h <= 100 for p, h in zip(figures["prefix_hit"], figures["hit"]))
    assert "shadow-vote" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--trace", "/nonexistent/trace"],
        ["--trace", "synthetic:requests=10", "--policies", "belady"],
        ["--trace", "synthetic:requests=10", "--capacities", "0,5"],
        ["--trace", "synthetic:requests=10", "--capacities", "x"],
        ["--trace", "synthetic:bogus=1"],
    ],
)
def test_policies_command_user_errors_exit_2(argv, capsys):
    assert main(["policies", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench policies:")
