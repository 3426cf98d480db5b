"""``kvbench vllm``'s multi-turn workload (bench/multi_turn.py), built from a trace without vLLM:
turns extend their conversation's earlier prompts token for token, other conversations come
between them, and what a perfect cache could reuse is counted."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.multi_turn import TurnResult, conversation_turns, read_trace, summarize

EXCERPT = Path(__file__).parents[2] / "bench" / "data" / "mooncake_conversation_head2000.jsonl.gz"


def record(ts: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": 512 * len(ids), "output_length": 10, "hash_ids": ids}


TRACE = [
    record(0, [0, 1, 2]),  # conversation A, turn 0
    record(1, [0, 5, 6]),  # B, turn 0
    record(2, [0, 9]),  # C: one turn only, never chosen
    record(3, [0, 1, 2, 3]),  # A, turn 1 (extends turn 0)
    record(4, [0, 5, 6, 7, 8, 20]),  # B, turn 1: six blocks
    record(5, [0, 1, 2, 3, 4]),  # A, turn 2
    record(6, [0, 5, 6, 7]),  # B, turn 2
]


def test_turns_extend_their_conversation_and_interleave_in_arrival_order():
    turns = conversation_turns(TRACE, conversations=2, max_turns=3, min_turns=2, block_tokens=4, max_blocks=6)
    assert [(t.conversation, t.turn) for t in turns] == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]
    a0, b0, a1, b1, a2, b2 = turns
    assert len(a0.prompt) == 12 and len(b1.prompt) == 24
    assert a1.prompt[:12] == a0.prompt and a2.prompt[:16] == a1.prompt  # the same ids, the same tokens
    assert b0.prompt[:4] == a0.prompt[:4] and b0.prompt[4:8] != a0.prompt[4:8]  # only the system block shared
    # what an unbounded cache would hold by then: A's first turn had nothing before it, B's shares the system block
    assert [t.reusable_tokens for t in turns] == [0, 4, 12, 12, 16, 16]


def test_only_conversations_that_fit_are_taken_and_too_few_is_an_error():
    turns = conversation_turns(TRACE, conversations=1, max_turns=3, min_turns=2, block_tokens=4, max_blocks=5)
    assert {t.conversation for t in turns} == {0} and len(turns) == 3  # B's six-block turn does not fit
    with pytest.raises(ValueError, match="only 1 conversations"):
        conversation_turns(TRACE, conversations=2, max_turns=3, min_turns=2, block_tokens=4, max_blocks=5)
    with pytest.raises(ValueError):
        conversation_turns(TRACE, conversations=1, max_turns=1, min_turns=2)


def test_the_shipped_excerpt_gives_the_default_workload(tmp_path):
    requests = read_trace(EXCERPT)
    turns = conversation_turns(requests, conversations=10, max_turns=5, min_turns=3, block_tokens=128, max_blocks=17)
    assert len({t.conversation for t in turns}) == 10 and len(turns) >= 30
    assert all(len(t.prompt) <= 17 * 128 and all(100 <= x < 49000 for x in t.prompt) for t in turns)
    assert sum(t.reusable_tokens for t in turns) > sum(len(t.prompt) for t in turns) / 2
    path = tmp_path / "trace.jsonl.gz"  # read_trace takes the trace's own format, blank lines and all
    with gzip.open(path, "wt") as f:
        f.write(json.dumps(TRACE[0]) + "\n\n")
    assert read_trace(path) == [TRACE[0]]


def test_summary_counts_recomputed_tokens_and_throughput():
    results = [TurnResult(1.0, 100, 0), TurnResult(0.2, 200, 150), TurnResult(0.4, 300, 200)]
    s = summarize(results, wall_s=2.0)
    assert s["requests"] == 3 and s["tokens_recomputed"] == 250 and s["prompt_tokens"] == 600
    assert s["ttft_mean_s"] == pytest.approx(1.6 / 3) and s["ttft_p90_s"] == pytest.approx(0.88)
    assert s["throughput_tokens_per_s"] == 300
