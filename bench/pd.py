"""``kvbench pd``: prefill-decode disaggregation through the store, against colocated serving.

1. Timing, with real processes: two daemons (a "prefill node" and a "decode node"), each
   with host RAM and a PFS tier on one shared directory whose bandwidth, reads and writes,
   is capped at ``--link-gbps`` (``tiers/throttle.py``): the link between the nodes. The
   prefill engine's durable puts cross it once, the decode engine's reads once more.
   Requests with the Mooncake trace's prompt and output lengths scaled down run one at a
   time (two CPU cores: concurrent engines would time each other) through the router for
   each configuration: colocated (one engine, no store), disaggregated raw, and
   disaggregated with each ``--codecs`` budget (fresh engines and a namespace of their own
   per configuration, so nothing is shared between them). TTFT (arrival to the first token
   at the router; disaggregated: once the prefill's puts returned), time per output token,
   bytes over the link (the PFS tier's bytes written by the prefill node) and seconds per
   request (the producer's puts, the consumer's loads).
2. Quality, in-process on one Store: the codecs' perplexity change on the probe text
   (``bench/probe_model.py``: the KV of 512 tokens, its full chunks through the transfer
   codec with its ranking, 512 continuation tokens scored), greedy exact-match against raw
   on held prompts, and needle-in-a-haystack retrieval at ``--needle-lengths``. The prefill
   runs once per prompt (raw); each codec's chunks are its raw chunks re-encoded exactly as
   its producer would put them, under a namespace of its own, and a consumer decodes.

``--quick``: a tiny random checkpoint and a few short requests (a CI smoke test).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from bench.pd_inputs import DEFAULT_TRACE, corpus_tokens, trace_lengths
from bench.pd_quality import quality
from bench.pd_timing import timing
from bench.pd_verdict import checks, format_table
from bench.progress import say


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("pd", help="prefill-decode disaggregation through the store vs colocated serving")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M GGUF; tiny with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny random model, a few short requests: a smoke test")
    p.add_argument("--codecs", default="mixed75,mixed50,mixed25", help="transfer codecs to compare with raw")
    p.add_argument("--importance", choices=("keynorm", "recency", "attention"), default="keynorm",
                   help="how mixed codecs rank a chunk's tokens (the first 4 of a prompt always on top)")
    p.add_argument("--link-gbps", type=float, default=1.0, help="link between the nodes, GB/s (the PFS tier's cap)")
    p.add_argument("--requests", type=int, default=4, help="timed requests per configuration")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (JSON lines): prompt/output lengths")
    p.add_argument("--prompt-scale", type=float, default=0.125, help="trace prompt lengths are scaled by this")
    p.add_argument("--output-scale", type=float, default=0.0625, help="trace output lengths are scaled by this")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=16)
    p.add_argument("--held-prompts", type=int, default=4, help="prompts for greedy exact-match")
    p.add_argument("--held-tokens", type=int, default=600, help="tokens per held prompt")
    p.add_argument("--needle-lengths", default="512,1024", help="haystack lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per engine")
    p.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from bench.cli import UsageError
    from engine import LLM, EngineConfig
    from engine.assets import smollm2_gguf_path
    from engine.router import Request
    from engine.sampling import SamplingParams
    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    args.codecs = [c for c in args.codecs.split(",") if c]
    if "raw" in args.codecs:
        raise UsageError("--codecs lists the lossy codecs; raw always runs")
    from kvstore.codecs import codec_names

    unknown = [c for c in args.codecs if c not in codec_names()]
    if unknown:
        raise UsageError(f"unknown codecs {unknown}; known: {codec_names()}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-pd-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if args.quick:
            args.requests, args.max_prompt, args.max_output, args.chunk_tokens = 2, 200, 4, 32
            args.held_prompts, args.held_tokens, args.needle_lengths = 2, 100, "128"
            model = args.model or make_tiny_checkpoint(root / "tiny", max_position_embeddings=1024)
        else:
            model = args.model or smollm2_gguf_path()
        args.needle_lengths = [int(x) for x in str(args.needle_lengths).split(",") if x]
        say("pd", f"loading {model}")
        base = LLM(model, EngineConfig(num_blocks=512 if not args.quick else 256, block_size=16, dtype="float32"))
        corpus = corpus_tokens(base.tokenizer)
        lengths = trace_lengths(args.trace, args.requests, args.prompt_scale, args.output_scale, args.max_prompt,
                                args.max_output, args.chunk_tokens)
        requests, offset = [], 0
        for i, (p, o) in enumerate(lengths):
            if offset + p > len(corpus):
                offset = 0
            requests.append(Request(f"r{i}", corpus[offset:offset + p],
                                    SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)))
            offset += p
        mc = base.model_config
        results = {"model": str(model), "quick": args.quick, "link_gbps": args.link_gbps,
                   "chunk_tokens": args.chunk_tokens, "threads": args.threads, "importance": args.importance,
                   "kv_bytes_per_token": mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4,
                   "requests": [{"prompt_tokens": len(r.prompt), "output_tokens": r.params.max_tokens}
                                for r in requests]}
        runs = timing(str(model), args, root, requests)
        q = quality(base, model, args, corpus)
        base.close()
        raw_out = runs["raw"]["outputs"]
        for name, run_ in runs.items():
            run_["stream_exact_match_vs_raw"] = sum(a == b for a, b in zip(run_.pop("outputs"), raw_out)) / len(raw_out)
            if name in q:
                qr = q[name]
                run_.update(ppl_change_pct=qr["ppl_change_pct"], exact_match=qr["exact_match"],
                            quality_loaded_tokens=qr["loaded_tokens"],
                            token_match=qr["token_match"], needle=qr["needle"], needle_text=qr["needle_text"],
                            needle_text_equals_raw=qr["needle_text"] == q["raw"]["needle_text"])
        runs["colocated"]["ppl_change_pct"] = 0.0
        results["runs"] = runs
        results["reference_ppl"] = q["reference_ppl"]
        results["checks"] = checks(runs)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0
