"""``kvbench engine``: throughput and latency of the bundled engine on CPU.

1. Continuous vs static batching: the same requests, with prompt/output lengths drawn from
   the Azure LLM conversation trace (scaled down to fit a CPU), run through our engine with
   continuous batching, and in fixed groups that each wait for their longest member.
2. Our engine vs transformers ``generate`` at batch 1 and 8 (same checkpoint, fp32).
3. TTFT percentiles per scheduling policy under bursty arrivals.

``--quick`` uses a tiny random checkpoint and a handful of requests (a CI smoke test).
"""

from __future__ import annotations

import csv
import gzip
import json
import random
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_TRACE = Path("/work/shared/traces/azure_conv_2023.csv.gz")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("engine", help="bundled engine: continuous vs static batching, vs transformers, TTFT")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M GGUF; tiny with --quick)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Azure conversation trace (gzip CSV)")
    p.add_argument("--quick", action="store_true", help="tiny random model, few requests: a smoke test")
    p.add_argument("--requests", type=int, default=32, help="requests in the batching comparison")
    p.add_argument("--batch", type=int, default=8, help="max running sequences / static group size")
    p.add_argument("--max-prompt", type=int, default=64, help="scaled prompt lengths are capped here")
    p.add_argument("--max-output", type=int, default=48, help="scaled output lengths are capped here")
    p.add_argument("--compare-tokens", type=int, default=32, help="tokens generated in the ours-vs-HF runs")
    p.add_argument("--burst-requests", type=int, default=18, help="requests in the TTFT run (3 bursts)")
    p.add_argument("--burst-gap", type=float, default=2.0, help="seconds between bursts")
    p.add_argument("--repeats", type=int, default=2,
                   help="alternating repeats of each measurement (best throughput, mean TTFT): the CPU is shared")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids spin contention)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def load_length_mix(trace: Path, n: int, max_prompt: int, max_output: int, seed: int) -> list[tuple[int, int]]:
    """``n`` (prompt, output) lengths sampled from the trace, scaled so the 90th percentile meets
    the caps (longer ones are clipped there): the mix keeps its shape at CPU-sized lengths."""
    if not trace.exists():
        raise FileNotFoundError(f"trace {trace} not found")
    with gzip.open(trace, "rt") as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    sample = rng.sample(rows, min(n, len(rows)))
    p90 = sorted(p for p, _ in sample)[int(0.9 * (len(sample) - 1))]
    o90 = sorted(o for _, o in sample)[int(0.9 * (len(sample) - 1))]
    return [(min(max_prompt, max(4, round(p * max_prompt / p90))), min(max_output, max(2, round(o * max_output / o90))))
            for p, o in sample]


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def engine_config(batch: int, policy: str = "fcfs"):
    """Prefix caching off: the benchmark's prompts are random, and it would only add noise."""
    return dict(num_blocks=1024, block_size=16, max_num_seqs=batch, max_num_batched_tokens=512, policy=policy,
                enable_prefix_caching=False)


def decode_throughput(llm, prompts, outputs, group: int | None) -> float:
    """Generated tokens per second; ``group`` set = static batching in groups of that size."""
    from engine import SamplingParams

    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outputs]
    groups = [range(len(prompts))] if group is None else \
        [range(i, min(i + group, len(prompts))) for i in range(0, len(prompts), group)]
    start = time.perf_counter()
    for g in groups:
        seqs = [llm.add_request(prompts[i], params[i]) for i in g]
        for _ in llm.stream_seqs(seqs):
            pass
    return sum(outputs) / (time.perf_counter() - start)


def ours_vs_hf(llm, hf, vocab: int, batch: int, tokens: int, seed: int) -> tuple[float, float]:
    import torch

    from engine import SamplingParams

    prompts = random_prompts([32] * batch, vocab, seed)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    ours = batch * tokens / (time.perf_counter() - start)
    ids = torch.tensor(prompts)
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                    do_sample=False, pad_token_id=0)
    theirs = batch * tokens / (time.perf_counter() - start)
    return ours, theirs


def bursty_ttft(llm, prompts, outputs, burst: int, gap_s: float) -> dict:
    """Requests arrive ``burst`` at a time every ``gap_s`` seconds; returns TTFT percentiles."""
    from engine import SamplingParams

    arrivals = [(i // burst) * gap_s for i in range(len(prompts))]
    pending = list(range(len(prompts)))
    seqs = []
    start = time.perf_counter()
    while pending or llm.has_unfinished():
        now = time.perf_counter() - start
        while pending and arrivals[pending[0]] <= now:
            i = pending.pop(0)
            params = SamplingParams(max_tokens=outputs[i], temperature=0, ignore_eos=True)
            seqs.append(llm.add_request(prompts[i], params, arrival_time=start + arrivals[i]))
        if llm.has_unfinished():
            llm.step()
        else:
            time.sleep(max(0.0, arrivals[pending[0]] - now))
    ttfts = sorted(s.metrics.ttft for s in seqs)

    def pct(q):
        return ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]

    return {"ttft_p50_s": pct(0.50), "ttft_p90_s": pct(0.90), "ttft_p99_s": pct(0.99),
            "ttft_mean_s": sum(ttfts) / len(ttfts)}


def progress(message: str) -> None:
    print(f"kvbench engine: {message}", file=sys.stderr, flush=True)


def run(args) -> int:
    import torch

    from engine.assets import smollm2_gguf_path
    from engine.policies import POLICIES
    from engine.testing import make_tiny_checkpoint, transformers_reference

    if not Path(args.trace).exists():
        raise FileNotFoundError(f"trace {args.trace} not found")
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            model = args.model or make_tiny_checkpoint(Path(tmp) / "tiny", num_layers=2)
            args.requests, args.batch, args.burst_requests, args.burst_gap, args.repeats = 8, 4, 6, 0.2, 1
            args.max_prompt, args.max_output, args.compare_tokens = 32, 8, 8
        else:
            model = args.model or smollm2_gguf_path()
        mix = load_length_mix(Path(args.trace), max(args.requests, args.burst_requests), args.max_prompt,
                              args.max_output, args.seed)
        progress(f"loading {model}")
        from engine import LLM, EngineConfig

        base = LLM(model, EngineConfig(dtype="float32", **engine_config(args.batch)))
        llm = base
        vocab = llm.model_config.vocab_size
        prompts = random_prompts([p for p, _ in mix], vocab, args.seed)
        outputs = [o for _, o in mix]
        n = args.requests
        decode_throughput(llm, prompts[:2], [2, 2], None)  # warm-up
        progress(f"continuous vs static batching, {n} requests")
        results = {
            "model": str(model),
            "quick": args.quick,
            "threads": args.threads,
            "batch": args.batch,
            "requests": n,
            "mean_prompt_tokens": sum(p for p, _ in mix[:n]) / n,
            "mean_output_tokens": sum(outputs[:n]) / n,
        }
        continuous, static = [], []
        for _ in range(args.repeats):  # alternate, so load changes on a shared machine hit both alike
            continuous.append(decode_throughput(llm, prompts[:n], outputs[:n], None))
            static.append(decode_throughput(llm, prompts[:n], outputs[:n], args.batch))
        results["continuous_tok_s"], results["static_tok_s"] = max(continuous), max(static)
        progress("ours vs transformers at batch 1 and 8")
        hf = transformers_reference(model)
        results["ours_tok_s"], results["hf_tok_s"] = {}, {}
        for b in (1, 8):
            ours, theirs = ours_vs_hf(base.with_config(**engine_config(b)), hf, vocab, b, args.compare_tokens, args.seed)
            results["ours_tok_s"][str(b)], results["hf_tok_s"][str(b)] = ours, theirs
        del hf
        progress("TTFT per policy under bursty arrivals")
        k = args.burst_requests
        names = sorted(POLICIES)
        runs = {name: [] for name in names}
        for r in range(args.repeats):
            for name in names if r % 2 == 0 else reversed(names):
                llm = base.with_config(**engine_config(args.batch, name))
                runs[name].append(bursty_ttft(llm, prompts[:k], outputs[:k], max(1, k // 3), args.burst_gap))
        results["policies"] = {name: {key: sum(x[key] for x in rs) / len(rs) for key in rs[0]}
                               for name, rs in runs.items()}
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def format_table(r: dict) -> str:
    lines = [
        f"model {r['model']}  threads {r['threads']}  batch {r['batch']}  requests {r['requests']} "
        f"(mean prompt {r['mean_prompt_tokens']:.0f}, mean output {r['mean_output_tokens']:.0f} tokens)",
        f"continuous batching {r['continuous_tok_s']:8.1f} tok/s   static {r['static_tok_s']:8.1f} tok/s   "
        f"ratio {r['continuous_tok_s'] / r['static_tok_s']:.2f}x",
    ]
    for b in ("1", "8"):
        lines.append(f"batch {b}: ours {r['ours_tok_s'][b]:8.1f} tok/s   transformers {r['hf_tok_s'][b]:8.1f} tok/s")
    lines.append("policy   TTFT p50     p90     p99   (s)")
    for name, p in r["policies"].items():
        lines.append(f"{name:6} {p['ttft_p50_s']:8.3f} {p['ttft_p90_s']:7.3f} {p['ttft_p99_s']:7.3f}")
    return "\n".join(lines)
