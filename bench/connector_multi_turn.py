"""``kvbench connector``'s multi-turn part: a conversation workload with and without the store.

Conversations derived from the Mooncake conversation trace (each turn extends an earlier
turn's prompt; a 512-token trace block becomes ``--block-tokens`` tokens), run one request
at a time, each through an engine without the store and one with an in-process store (host
RAM holding a third of the workload's chunks, the rest on disk) in turn; both engines'
KV-cache budget is one longest prompt, too small to hold every conversation: mean and P90
TTFT, tokens recomputed, hit tokens by tier.
"""

from __future__ import annotations

import gzip
import json
import random
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.connector import Setup

_FULL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl.gz"
DEFAULT_TRACE = _FULL_TRACE if _FULL_TRACE.exists() else Path(__file__).parent / "data" / "mooncake_conversation_head2000.jsonl.gz"
TRACE_BLOCK_TOKENS = 512  # the Mooncake trace hashes its prompts in blocks of this many tokens


def conversation_prompts(trace: Path, conversations: int, turns: int, block_tokens: int, max_prompt: int,
                         vocab: int, seed: int) -> list[tuple[int, list[int]]]:
    """(conversation, prompt) in trace order for the first ``conversations`` conversations with
    ``turns`` turns. A request continues the conversation of the earliest request it shares
    at least two leading trace blocks with (block 0, a common system prompt, alone does not
    count); a trace block id becomes ``block_tokens`` tokens drawn from a generator seeded
    with it, so equal trace prefixes give equal token prefixes."""
    if not trace.exists():
        raise FileNotFoundError(f"trace {trace} not found")
    with gzip.open(trace, "rt") as f:
        rows = [json.loads(line) for line in f]
    owner: dict[int, int] = {}
    conversation_of: list[int] = []
    for i, row in enumerate(rows):
        ids, shared = row["hash_ids"], 0
        while shared < len(ids) and ids[shared] in owner:
            shared += 1
        conversation_of.append(conversation_of[owner[ids[shared - 1]]] if shared >= 2 else i)
        for h in ids:
            owner.setdefault(h, i)
    members: dict[int, list[int]] = {}
    for i, c in enumerate(conversation_of):
        members.setdefault(c, []).append(i)
    chosen = [c for c in sorted(members) if len(members[c]) >= turns][:conversations]
    if len(chosen) < conversations:
        raise ValueError(f"the trace has only {len(chosen)} conversations of {turns} turns")
    picked = sorted((i, n) for n, c in enumerate(chosen) for i in members[c][:turns])

    def block(h: int) -> list[int]:
        rng = random.Random(seed * 1_000_003 + h)
        return [rng.randrange(3, vocab) for _ in range(block_tokens)]

    out = []
    for i, n in picked:
        row = rows[i]
        length = min(max_prompt, -(-row["input_length"] * block_tokens // TRACE_BLOCK_TOKENS))
        tokens = [t for h in row["hash_ids"] for t in block(h)]
        out.append((n, tokens[:length]))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(metrics: list, store=None, tiers_before=None, chunk_tokens: int = 0) -> dict:
    ttfts = [m.ttft for m in metrics]
    result = {
        "requests": len(metrics),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "prompt_tokens": sum(m.num_prompt_tokens for m in metrics),
        "recomputed_tokens": sum(m.num_prefilled_tokens for m in metrics),
        "hit_tokens": {"device": sum(m.num_cached_tokens for m in metrics)},
    }
    if store is not None:
        for name, t in store.stats().tiers.items():
            result["hit_tokens"][name] = (t.hits - tiers_before[name]) * chunk_tokens
        result["loaded_tokens"] = sum(m.num_loaded_tokens for m in metrics)
    return result


def multi_turn(base, setup: Setup, args) -> dict:
    """Each request runs through an engine without the store and one with it, in turn (the
    order alternating), so both see the same load on a shared machine; the engines have
    separate KV caches of the same size."""
    from bench.connector import kv_bytes_per_token, progress
    from engine import SamplingParams
    from kvstore.store import Store

    vocab = base.model_config.vocab_size
    prompts = conversation_prompts(Path(args.trace), args.conversations, args.turns, args.block_tokens,
                                   args.max_prompt, vocab, args.seed)
    longest = max(len(p) for _, p in prompts)
    num_blocks = int(args.budget_prompts * longest) // setup.block_size + 1
    engine = dict(num_blocks=num_blocks, max_num_batched_tokens=longest)
    chunk_bytes = setup.chunk_tokens * kv_bytes_per_token(base)
    distinct = {tuple(p[:i + setup.chunk_tokens]) for _, p in prompts
                for i in range(0, len(p) - setup.chunk_tokens + 1, setup.chunk_tokens)}
    host_bytes = max(len(distinct) // 3, 2) * (chunk_bytes + (1 << 20)) + (32 << 20)
    info = {"conversations": args.conversations, "turns": args.turns, "requests": len(prompts),
            "mean_prompt_tokens": statistics.fmean(len(p) for _, p in prompts), "kv_cache_blocks": num_blocks,
            "kv_cache_tokens": num_blocks * setup.block_size, "distinct_chunks": len(distinct),
            "store_host_bytes": host_bytes}
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    progress(f"multi-turn: {len(prompts)} requests, each without and with the store")
    with Store(setup.store_config(host_bytes, setup.root / "multi-turn")) as store, \
            base.with_config(**engine) as plain, \
            base.with_config(kv_store=store, connector=setup.connector_config(), **engine) as stored:
        tiers_before = {n: t.hits for n, t in store.stats().tiers.items()}
        without, with_store = [], []
        for i, (_, prompt) in enumerate(prompts):
            pair = [(plain, without), (stored, with_store)]
            for llm, out in pair if i % 2 == 0 else reversed(pair):
                out.append(llm.generate(prompt, params)[0].metrics)
        return {**info, "without_store": summary(without),
                "with_store": summary(with_store, store, tiers_before, setup.chunk_tokens)}
