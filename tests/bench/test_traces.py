"""Trace formats, the synthetic workload generator and the ``kvbench policies`` and ``reuse`` commands."""

import gzip
import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.reuse import AGE_EDGES, reuse_hazard
from bench.sim import capacity_blocks, simulate
from bench.synthetic import SyntheticSpec, generate, parse_spec
from bench.traces import Trace, load_trace
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
    (tmp_path / "prose.md").write_text("# kvstore\n\n1 2 3\nLLM engines recompute the prefill\n")
    with pytest.raises(ValueError, match="prose.md:4: not a trace"):
        load_trace(str(tmp_path / "prose.md"))
    (tmp_path / "azure.csv").write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.97,374,44\n")
    with pytest.raises(ValueError, match="no block hashes"):
        load_trace(str(tmp_path / "azure.csv"))


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
    specs = ("synthetic:requests=2500,seed=11", "synthetic:requests=2500,seed=12,docs=300,zipf=1.3,conv_share=0.2", "synthetic:requests=2500,seed=13,think=40")
    for spec in specs:
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


def test_policies_command_experts_and_their_bound(capsys):
    from kvstore.policies.shadow_vote import EXPERT_POLICIES

    assert main(["policies", "--trace", "workload:chat:requests=300", "--capacities", "5", "--policies", "experts,default"]) == 0
    out = capsys.readouterr().out
    assert all(f"expert:{name} " in out for name in EXPERT_POLICIES)
    assert "shadow-vote minus best expert" in out


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


def _turn_gaps(requests, system_blocks):
    """Requests between a conversation block's consecutive uses."""
    last, gaps = {}, []
    for i, request in enumerate(requests):
        for key in request[system_blocks:]:
            if key in last:
                gaps.append(i - last[key])
            last[key] = i
    return gaps


def test_synthetic_think_time_spaces_a_conversations_turns():
    spec = dict(requests=3000, seed=7, doc_share=0.0, conv_share=0.8)
    at_once = _turn_gaps(generate(SyntheticSpec(**spec)), SyntheticSpec.system_blocks)
    thinking = _turn_gaps(generate(SyntheticSpec(**spec, think=200.0)), SyntheticSpec.system_blocks)
    def short(gaps):
        return sum(g < 20 for g in gaps) / len(gaps)

    assert short(thinking) < short(at_once) / 2
    assert sum(thinking) / len(thinking) > sum(at_once) / len(at_once)
    assert parse_spec("synthetic:think=50").think == 50.0


def test_reuse_hazard_counts_by_hand():
    # a0..a9 then their prompts' last chunks b0..b9 (t = 0..19), 30 one-block prompts, then
    # a0..a4 again: with a capacity of 10 blocks each a_i < 5 comes back 5 capacities later
    requests = [[f"a{i}", f"b{i}"] for i in range(10)] + [[f"f{j}"] for j in range(30)]
    requests += [[f"a{i}", f"c{i}"] for i in range(5)]
    result = reuse_hazard(Trace("hand", requests), capacity=10)
    first = result["1st"]
    assert first["accesses"] == 10
    i48 = AGE_EDGES.index(4.0)
    assert first["hazard"][:i48] == [0.0] * i48 and first["at_risk"][:i48] == [10] * i48
    assert first["at_risk"][i48] == 5 and first["hazard"][i48] == pytest.approx(5 / 5 / 4)
    assert result["1st, prompt's last chunk"]["accesses"] == 10 + 30 + 5
    assert result["2nd"]["accesses"] == 5 and result["5th+"]["accesses"] == 0


def test_reuse_command_json_and_errors(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["reuse", "--trace", "synthetic:requests=300,think=20", "--capacity", "5", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["age_edges"] == list(AGE_EDGES) and result["capacity_pct"] == 5
    assert set(result["classes"]) == {"1st, prompt's last chunk", "1st", "2nd", "3rd-4th", "5th+"}
    assert "after access" in capsys.readouterr().out
    assert main(["reuse", "--trace", "synthetic:requests=10", "--capacity", "0"]) == 2
    assert main(["reuse", "--trace", "/nonexistent/trace"]) == 2


def test_policy_cost_command_reports_both_paths(capsys):
    assert main(["policy-cost", "--trace", "workload:chat:requests=60", "--requests", "40", "--capacity", "10"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("policy")
    assert [line.split()[0] for line in lines[1:]] == ["lru", "default"]
    assert lines[1].split()[-1] == "+0.0"
