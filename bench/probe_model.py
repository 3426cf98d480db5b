"""Running a Llama-family model with transformers for the codec quality probe.

Loads a GGUF file (dequantised to fp32, converted once) or a Hugging Face model directory,
computes a prefix's KV as a chunk-layout tensor ``[layers, 2, tokens, kv_heads, head_dim]``, and
scores a continuation against any KV put back in its place. transformers is imported
only when a model is loaded, so ``kvbench`` starts fast for every other command.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from bench.cli import UsageError


@dataclass
class LoadedModel:
    model_id: str
    model: object
    tokenizer: object


def load_model(path: Path) -> LoadedModel:
    """A GGUF file, a directory with one GGUF file, or a directory with config.json. A GGUF
    is read through transformers' own converter, once: ``engine.testing.transformers_copy``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.testing import transformers_copy

    if path.is_file() and path.suffix == ".gguf":
        gguf, model_id = path, path.stem
    elif path.is_dir() and (path / "config.json").exists():
        gguf, model_id = None, path.name
    elif path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        gguf, model_id = ggufs[0], ggufs[0].stem
    else:
        raise UsageError(f"{path} is not a GGUF file or a model directory (config.json or one .gguf)")
    try:
        directory = path if gguf is None else transformers_copy(gguf)
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    except OSError as exc:  # missing tokenizer or weight files
        raise UsageError(f"cannot load a model from {path}: {exc}") from None
    return LoadedModel(model_id, model, tokenizer)


def token_ids(loaded: LoadedModel, text: str) -> torch.Tensor:
    return loaded.tokenizer(text, return_tensors="pt").input_ids[0]


@torch.no_grad()
def prefix_kv(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """The KV of ``ids`` in chunk layout ``[layers, 2, tokens, kv_heads, head_dim]`` (fp32)."""
    cache = loaded.model(ids.unsqueeze(0), use_cache=True).cache
    kv = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
    return kv.permute(0, 1, 3, 2, 4).contiguous()


@torch.no_grad()
def prefix_attention(loaded: LoadedModel, ids: torch.Tensor) -> torch.Tensor:
    """Attention probabilities of the prefix ``ids`` ``[layers, heads, queries, keys]`` (eager
    attention for this call, the only kind that returns them)."""
    model = loaded.model
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        attentions = model(ids.unsqueeze(0), use_cache=False, output_attentions=True).attentions
    finally:
        model.set_attn_implementation(previous)
    return torch.stack([a[0] for a in attentions])


@torch.no_grad()
def continuation_logits(loaded: LoadedModel, kv: torch.Tensor, ids: torch.Tensor,
                        keep: torch.Tensor | None = None) -> torch.Tensor:
    """Logits ``[len(ids), vocab]`` for ``ids`` following a prefix whose KV is ``kv``; with
    ``keep`` (bool per prefix token), the other prefix tokens are dropped (masked out)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    dtype = loaded.model.dtype
    for index, layer in enumerate(kv.to(dtype).permute(0, 1, 3, 2, 4)):
        cache.update(layer[0].unsqueeze(0).contiguous(), layer[1].unsqueeze(0).contiguous(), index)
    kwargs = {}
    if keep is not None:
        kwargs["attention_mask"] = torch.cat([keep.long(), torch.ones(len(ids), dtype=torch.long)]).unsqueeze(0)
    return loaded.model(ids.unsqueeze(0), cache=cache, use_cache=True, **kwargs).logits[0].float()
