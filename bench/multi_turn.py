"""A multi-turn conversation workload from the Mooncake conversation trace, scaled down to run
in a few minutes on a small CPU (``kvbench vllm``'s "multi_turn" section).

The trace (``shared/traces/mooncake_conversation_trace.jsonl.gz``, see its README) lists
requests in arrival order, each with one *prefix* hash id per 512-token block of its input: an
equal id means an equal prefix. A conversation is the requests sharing their first two ids (the
first is a system prompt every request shares); each turn extends an earlier one. Scaling: each
trace block becomes ``block_tokens`` tokens (ids drawn from a generator seeded by the block's
hash id, so an equal id gives equal tokens), and only conversations whose first ``max_turns``
turns fit ``max_blocks`` blocks are taken. Their turns are sent in the trace's arrival order,
so other conversations' turns come between two of one conversation, as on a server.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# the whole trace where the checkout sits beside ../shared/traces, else the excerpt it ships
_FULL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl.gz"
TRACE = _FULL_TRACE if _FULL_TRACE.exists() else Path(__file__).parent / "data" / "mooncake_conversation_head2000.jsonl.gz"
TOKEN_RANGE = (100, 49000)  # SmolLM2's vocabulary is 49,152 ids; the first hundred hold special tokens


@dataclass(frozen=True)
class Turn:
    conversation: int  # index among the chosen conversations
    turn: int  # 0 for a conversation's first request
    arrival_s: float  # the trace's timestamp
    prompt: tuple[int, ...]
    reusable_tokens: int  # leading tokens an earlier turn of the workload had (what a perfect cache saves)


def read_trace(path: Path = TRACE) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def block_tokens_of(hash_id: int, block_tokens: int) -> list[int]:
    """The tokens standing for one trace block: the same for the same id, in every run."""
    rng = np.random.default_rng(hash_id)
    return rng.integers(TOKEN_RANGE[0], TOKEN_RANGE[1], size=block_tokens).tolist()


def conversation_turns(requests: list[dict], conversations: int, max_turns: int, min_turns: int = 2,
                       block_tokens: int = 128, max_blocks: int = 15) -> list[Turn]:
    """The first ``conversations`` conversations of ``requests`` (trace records, in arrival
    order) with at least ``min_turns`` turns, whose first ``max_turns`` turns each fit in
    ``max_blocks`` blocks; those turns, in arrival order."""
    if min_turns < 1 or max_turns < min_turns:
        raise ValueError(f"need 1 <= min_turns <= max_turns, got {min_turns}, {max_turns}")
    by_conversation: dict[tuple[int, int], list[dict]] = {}
    for record in requests:
        ids = record["hash_ids"]
        if len(ids) >= 2:
            by_conversation.setdefault((ids[0], ids[1]), []).append(record)
    chosen = []
    for records in by_conversation.values():  # in order of their first turn's arrival
        records = records[:max_turns]
        if len(records) >= min_turns and all(len(r["hash_ids"]) <= max_blocks for r in records):
            chosen.append(records)
            if len(chosen) == conversations:
                break
    if len(chosen) < conversations:
        raise ValueError(f"only {len(chosen)} conversations of {min_turns}+ turns fit {max_blocks} blocks")
    sent = [(r["timestamp"], c, t, r) for c, records in enumerate(chosen) for t, r in enumerate(records)]
    sent.sort(key=lambda s: (s[0], s[1], s[2]))
    turns, seen = [], set()
    for timestamp, c, t, record in sent:
        ids = record["hash_ids"]
        reused = 0
        while reused < len(ids) and ids[reused] in seen:
            reused += 1
        seen.update(ids)
        prompt = [token for hash_id in ids for token in block_tokens_of(hash_id, block_tokens)]
        turns.append(Turn(c, t, timestamp / 1000.0, tuple(prompt), reused * block_tokens))
    return turns


@dataclass(frozen=True)
class TurnResult:
    seconds: float  # the request's wall time with one output token: its TTFT
    prompt_tokens: int
    cached_tokens: int  # vLLM's num_cached_tokens: its own prefix cache and the connector's loads


def summarize(results: list[TurnResult], wall_s: float) -> dict:
    """Mean and P90 TTFT, throughput (prompt tokens per second of the whole run) and the
    prompt tokens computed rather than found cached."""
    ttfts = sorted(r.seconds for r in results)
    prompt = sum(r.prompt_tokens for r in results)
    recomputed = sum(r.prompt_tokens - r.cached_tokens for r in results)
    return {"requests": len(results), "ttft_mean_s": float(np.mean(ttfts)),
            "ttft_p90_s": float(np.percentile(ttfts, 90)), "wall_s": wall_s,
            "throughput_tokens_per_s": prompt / wall_s if wall_s > 0 else None,
            "throughput_requests_per_s": len(results) / wall_s if wall_s > 0 else None,
            "prompt_tokens": prompt, "tokens_recomputed": recomputed}
