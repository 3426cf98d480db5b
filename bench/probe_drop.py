"""``kvbench probe-drop``: what dropping tokens from the KV costs a real model, beside what
quantising it to the same size costs (issue 17: token dropping as a compression method).

The model reads ``--tokens`` tokens of a text; a keep set of that prefix is chosen, the
dropped tokens are masked out of attention (what a store that never saved them gives the
model), and the next ``--continuation`` tokens are scored against the whole prefix. Keep
sets always hold the first 4 tokens (attention sinks) and the prefix's last ``--window``
tokens, and fill the rest by:

- ``attention``: the most attention mass from the last ``--window`` prefix queries, summed
  over layers and heads (SnapKV's observation window, one keep set for every head);
- ``recent``: the latest tokens (StreamingLLM).

Sizes are keep fractions; each row names the codec of (about) that size whose perplexity
change the verdict file gives, to compare at equal bytes.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cli import UsageError

# torch is imported where it runs: `kvbench --help` and a mistyped argument go without its
# seconds of start-up.
if TYPE_CHECKING:
    import torch

DEFAULT_TEXT = Path(__file__).parent / "data" / "probe_prose.txt"
DEFAULT_VERDICTS = Path(__file__).parent / "data" / "verdicts" / "SmolLM2-135M-Instruct.Q4_1.float16.json"
SINKS = 4


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("probe-drop", help="measure token dropping's effect on a real model's perplexity")
    p.add_argument("--model", type=Path, help="GGUF file or HF model directory (default: SmolLM2-135M GGUF)")
    p.add_argument("--tokens", type=int, default=512, help="prefix tokens")
    p.add_argument("--continuation", type=int, default=512, help="tokens scored after the prefix")
    p.add_argument("--keep", default="0.75,0.5,0.375", help="keep fractions to try")
    p.add_argument("--window", type=int, default=32, help="observation window and always-kept recent tokens")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text the model reads")
    p.add_argument("--verdicts", type=Path, default=DEFAULT_VERDICTS, help="codec verdicts to compare with")
    p.add_argument("--json", type=Path, help="also write the results as JSON")
    p.set_defaults(func=run)


def keep_set(scores: torch.Tensor, keep: int, window: int) -> torch.Tensor:
    """The ``keep`` highest-scoring positions, sinks and the last ``window`` always among them."""
    import torch

    scores = scores.clone().float()
    scores[:SINKS] = math.inf
    scores[-window:] = math.inf
    mask = torch.zeros(len(scores), dtype=torch.bool)
    mask[scores.topk(min(keep, len(scores))).indices] = True
    return mask


def run(args) -> int:
    fractions = [float(f) for f in args.keep.split(",")]
    if any(not 0 < f <= 1 for f in fractions) or args.window < 1 or args.continuation < 2:
        raise UsageError("--keep fractions must be in (0, 1], --window >= 1, --continuation >= 2")
    if args.tokens < SINKS + args.window:
        raise UsageError(f"--tokens must be at least {SINKS + args.window} (sinks and window)")
    import torch

    from bench import probe_model

    path = args.model
    if path is None:
        from engine.assets import smollm2_gguf_path

        path = smollm2_gguf_path()
    loaded = probe_model.load_model(path)
    ids = probe_model.token_ids(loaded, args.text.read_text(encoding="utf-8"))
    if len(ids) < args.tokens + args.continuation:
        raise UsageError(f"{args.text} has {len(ids)} tokens; --tokens + --continuation need more")
    prefix, continuation = ids[: args.tokens], ids[args.tokens : args.tokens + args.continuation]
    kv = probe_model.prefix_kv(loaded, prefix).half()
    targets = continuation[1:]

    def perplexity(keep: torch.Tensor | None) -> float:
        logits = probe_model.continuation_logits(loaded, kv, continuation, keep)
        return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], targets)))

    reference = perplexity(None)
    attention = probe_model.prefix_attention(loaded, prefix)[:, :, -args.window:, :].sum(dim=(0, 1, 2))
    rankings = {"attention": attention, "recent": torch.arange(args.tokens)}
    codecs = json.loads(args.verdicts.read_text())["codecs"] if args.verdicts.exists() else {}
    rows = []
    for fraction in fractions:
        keep = max(SINKS + args.window, round(fraction * args.tokens))
        row = {"keep_fraction": keep / args.tokens}
        for name, scores in rankings.items():
            row[name] = (perplexity(keep_set(scores, keep, args.window)) / reference - 1) * 100
        near = min(codecs.items(), key=lambda kv: abs(kv[1].get("size_ratio", 9) - keep / args.tokens), default=None)
        if near is not None:
            row["codec"] = {"name": near[0], "size_ratio": near[1]["size_ratio"], "ppl_change_pct": near[1]["ppl_change_pct"]}
        rows.append(row)
    report = {"model": loaded.model_id, "prefix_tokens": args.tokens, "continuation_tokens": args.continuation,
              "window": args.window, "reference_ppl": reference, "rows": rows}
    print(f"model {loaded.model_id}  prefix {args.tokens}  continuation {args.continuation}  reference ppl {reference:.3f}")
    print(f"{'kept':>6} {'attention':>10} {'recent':>8}   codec of that size (ppl change)")
    for r in rows:
        c = r.get("codec")
        print(f"{r['keep_fraction']:6.3f} {r['attention']:+9.2f}% {r['recent']:+7.2f}%   "
              + (f"{c['name']} at {c['size_ratio']:.3f}: {c['ppl_change_pct']:+.2f}%" if c else "-"))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0
