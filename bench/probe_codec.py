"""``kvbench probe-codec``: how much each codec's KV changes a real model's predictions.

The model reads a text; the KV of its first ``--tokens`` tokens is cut into chunks, each
chunk goes through a codec's encode and decode, and the next ``--continuation`` tokens are
scored on the decoded KV. Perplexity change, top-1 agreement and KL divergence are
measured against the same KV stored raw in the same dtype, so ``raw`` is exactly 0% by
construction. The verdict file (schema in docs/codecs.md) tells placement which lossy
codecs this model tolerates; it names the model by the id its chunks' namespaces carry (the
engine's fingerprint of the weights, unless ``--model-id`` says otherwise), and placement
applies it to that model's chunks only.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from bench.cli import UsageError
from bench.progress import Progress

# torch, the codecs, the baselines and placement are imported where they run: `kvbench --help`
# and a mistyped argument go without their seconds of start-up.
if TYPE_CHECKING:
    import torch

    from kvstore.codecs.base import Codec

DEFAULT_TEXT = Path(__file__).parent / "data" / "probe_prose.txt"
DTYPES = ("bfloat16", "float16", "float32")  # torch's names


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("probe-codec", help="measure each codec's effect on a real model's perplexity")
    p.add_argument("--model", type=Path, help="GGUF file or HF model directory (default: SmolLM2-135M GGUF)")
    p.add_argument("--codecs", help="comma-separated codec names (default: every registered codec)")
    p.add_argument("--tokens", type=int, default=512, help="prefix tokens whose KV is encoded")
    p.add_argument("--continuation", type=int, default=512, help="tokens scored after the prefix")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per encoded chunk")
    p.add_argument("--dtype", choices=DTYPES, default="float16", help="dtype the KV is stored in")
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT, help="UTF-8 text the model reads")
    p.add_argument("--max-ppl-change", type=float, default=2.0, help="allowed perplexity change either way, %%")
    p.add_argument("--min-top1", type=float, default=95.0, help="required top-1 agreement, %%")
    p.add_argument("--model-id", help="namespace model id the verdicts hold for (default: the engine's fingerprint "
                                      "of the weights; set it to a deployment's connector.model_id)")
    p.add_argument("--out", type=Path, help="write the verdict JSON here")
    p.set_defaults(func=run)


def run(args) -> int:
    codecs = _codecs(args.codecs)
    if args.tokens < 1 or args.continuation < 2 or args.chunk_tokens < 1:
        raise UsageError("--tokens and --chunk-tokens must be >= 1 and --continuation >= 2")
    import torch

    from bench import probe_model
    from bench.probe_baselines import baselines
    from engine.models.loader import model_fingerprint
    from kvstore.store.placement import VERDICT_SCHEMA

    path = args.model
    if path is None:
        from engine.assets import smollm2_gguf_path

        path = smollm2_gguf_path()
    if not path.exists():
        raise UsageError(f"model {path} does not exist")
    _say(f"loading {path} (a GGUF file is converted once, which takes a minute)")
    loaded = probe_model.load_model(path)
    model_id = args.model_id or model_fingerprint(path)
    ids = probe_model.token_ids(loaded, args.text.read_text(encoding="utf-8"))
    if len(ids) < args.tokens + args.continuation:
        raise UsageError(f"{args.text} has {len(ids)} tokens; --tokens + --continuation need more")
    prefix, continuation = ids[: args.tokens], ids[args.tokens : args.tokens + args.continuation]
    _say(f"the reference: the KV of {args.tokens} tokens, {args.continuation} scored on it")
    kv = probe_model.prefix_kv(loaded, prefix).to(getattr(torch, args.dtype))
    reference = probe_model.continuation_logits(loaded, kv, continuation)
    targets = continuation[1:]
    reference_ppl = _perplexity(reference, targets)
    all_baselines = baselines()
    # each verdict scores the continuation once more: seconds to a minute with a real model
    progress = Progress(len(codecs) + len(all_baselines), "codecs scored")

    def verdict(codec: Codec) -> dict:
        try:
            return _verdict(codec)
        finally:
            progress.step(what=codec.name)

    def _verdict(codec: Codec) -> dict:
        try:
            decoded, ratio = _round_trip(codec, kv, args.chunk_tokens)
        except ValueError as exc:
            return {"lossless": codec.lossless, "error": str(exc), "allowed": False}
        logits = probe_model.continuation_logits(loaded, decoded, continuation)
        ppl = _perplexity(logits, targets)
        change = (ppl / reference_ppl - 1.0) * 100.0
        top1 = float((logits[:-1].argmax(-1) == reference[:-1].argmax(-1)).float().mean()) * 100.0
        allowed = abs(change) <= args.max_ppl_change and top1 >= args.min_top1
        return {
            "lossless": codec.lossless,
            "size_ratio": ratio,
            "ppl": ppl,
            "ppl_change_pct": change,
            "top1_agreement_pct": top1,
            "kl_divergence": _kl_divergence(reference, logits),
            "allowed": allowed,
        }

    result = {
        "schema": VERDICT_SCHEMA,
        "model": loaded.model_id,
        "model_id": model_id,
        "model_path": str(path),
        "dtype": args.dtype,
        "text": str(args.text),
        "prefix_tokens": args.tokens,
        "continuation_tokens": args.continuation,
        "chunk_tokens": args.chunk_tokens,
        "thresholds": {"max_ppl_change_pct": args.max_ppl_change, "min_top1_agreement_pct": args.min_top1},
        "reference_ppl": reference_ppl,
        "codecs": {c.name: {"codec_id": c.codec_id, **verdict(c)} for c in codecs},
        "baselines": {c.name: verdict(c) for c in all_baselines},
    }
    print(_table(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


def _say(message: str) -> None:
    """A phase's start on stderr, in the progress lines' form: a run of minutes is never silent."""
    print(f"  probe-codec: {message}", file=sys.stderr, flush=True)


def _codecs(names: str | None) -> list[Codec]:
    from kvstore.codecs import codec_names, get_codec

    chosen = names.split(",") if names else codec_names()
    unknown = [n for n in chosen if n not in codec_names()]
    if unknown:
        raise UsageError(f"unknown codecs {unknown}; known: {codec_names()}")
    return [get_codec(n) for n in chosen]


def _round_trip(codec: Codec, kv: torch.Tensor, chunk_tokens: int) -> tuple[torch.Tensor, float]:
    """``kv`` after each chunk went through ``codec``, and the payload size over the raw size."""
    import torch

    decoded = torch.empty_like(kv)
    payload_bytes = 0
    for start in range(0, kv.shape[2], chunk_tokens):
        chunk = kv[:, :, start : start + chunk_tokens].contiguous()
        payload = codec.encode(chunk)
        payload_bytes += len(payload)
        decoded[:, :, start : start + chunk_tokens] = codec.decode(payload, tuple(chunk.shape), chunk.dtype)
    return decoded, payload_bytes / (kv.numel() * kv.element_size())


def _perplexity(logits: torch.Tensor, targets: torch.Tensor) -> float:
    import torch

    return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], targets)))


def _kl_divergence(reference: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean KL(reference || codec) over the scored positions, in nats per token."""
    ref = reference[:-1].log_softmax(-1)
    return float((ref.exp() * (ref - logits[:-1].log_softmax(-1))).sum(-1).mean())


def _table(result: dict) -> str:
    lines = [
        f"model {result['model']}  dtype {result['dtype']}  prefix {result['prefix_tokens']}  "
        f"continuation {result['continuation_tokens']}  reference ppl {result['reference_ppl']:.3f}",
        f"{'codec':<18} {'size':>7} {'ppl chg %':>10} {'top-1 %':>8} {'KL nats':>9}  allowed",
    ]
    rows = list(result["codecs"].items()) + list(result["baselines"].items())
    for name, v in rows:
        if "error" in v:
            lines.append(f"{name:<18} error: {v['error']}")
        else:
            lines.append(
                f"{name:<18} {v['size_ratio']:>7.3f} {v['ppl_change_pct']:>+10.3f} "
                f"{v['top1_agreement_pct']:>8.2f} {v['kl_divergence']:>9.5f}  {'yes' if v['allowed'] else 'no'}"
            )
    return "\n".join(lines)
