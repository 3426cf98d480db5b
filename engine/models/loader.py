"""Load a Llama-family checkpoint: an HF folder (config.json + safetensors) or one GGUF file.

GGUF tensors are dequantised to float32 with the ``gguf`` package and renamed to HF names.
llama.cpp's converter permutes the rows of Llama's Q and K projections (interleaved rotary
pairs); we undo that so one model with HF's rotate-half RoPE serves both formats. The result
is kept beside the GGUF (``<file>.engine-fp32.safetensors``) so later loads skip the parse.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import torch
import xxhash

from engine.cachefiles import remove, remove_dead_temps, temp_path
from engine.config import DTYPES, ModelConfig
from engine.models.llama import LlamaForCausalLM
from kvstore.keys import weights_fingerprint

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def resolve_model_path(path: str | Path) -> Path:
    """The checkpoint a path names: an HF folder, a .gguf file, or a folder holding one .gguf."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"model path {str(p)!r} does not exist")
    if p.is_dir() and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ValueError(f"{p} has no config.json and {len(ggufs)} .gguf files (need exactly one)")
        return ggufs[0]
    return p


def model_fingerprint(path: str | Path) -> str:
    """The model id every namespace of ours carries for the checkpoint ``path`` names
    (``kvstore.keys.weights_fingerprint`` of its weights)."""
    return weights_fingerprint(resolve_model_path(path))


def load_model(path: str | Path, dtype: str | None = None, device: str = "cpu",
               fingerprint: str | None = None) -> LlamaForCausalLM:
    """Build the model for ``path`` and load its weights; ``dtype`` None keeps the checkpoint's.
    ``fingerprint`` is ``model_fingerprint(path)`` where the caller has it (it reads every byte)."""
    p = resolve_model_path(path)
    if p.is_dir():
        cfg = ModelConfig.from_hf(json.loads((p / "config.json").read_text()))
        weights = read_safetensors(p)
    else:
        cfg, weights = gguf_weights(p, fingerprint)
    if dtype is not None:
        cfg.dtype = dtype
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    assign_weights(model, weights, DTYPES[cfg.dtype], device)
    return model.eval()


def assign_weights(model: LlamaForCausalLM, weights: dict[str, torch.Tensor], dtype, device) -> None:
    """Check names and shapes, then move the checkpoint's tensors into the (meta) model."""
    tied = model.config.tie_word_embeddings
    expected = {n: p.shape for n, p in model.named_parameters() if not (tied and n == "lm_head.weight")}
    missing = sorted(set(expected) - set(weights))
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint is missing tensors: {', '.join(missing[:5])}{more}")
    for name, shape in expected.items():
        if tuple(weights[name].shape) != tuple(shape):
            raise ValueError(
                f"tensor {name} has shape {tuple(weights[name].shape)}, the config implies {tuple(shape)}"
            )
    state = {n: weights[n].to(device=device, dtype=dtype) for n in expected}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()


def read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no .safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


WEIGHT_CACHE_FORMAT = "1"


def gguf_weights(path: Path, fingerprint: str | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """The GGUF's config and float32 weights under HF names, in HF's row order.

    Parsing a GGUF takes seconds (its vocabulary is ~100k metadata fields, read one by one)
    and so does dequantising, so the result is kept in ``<file>.engine-fp32.safetensors``
    beside it and served from there while it names this GGUF's content fingerprint and its
    own digest matches. fp32 because that is what Q4_1/Q8_0 dequantise to (fp16 would round
    ``scale * q + min``). ``KVSTORE_WEIGHT_CACHE=0`` neither reads nor writes it."""
    use_cache = os.environ.get("KVSTORE_WEIGHT_CACHE", "1") != "0"
    cache = path.with_name(path.name + ".engine-fp32.safetensors")
    fingerprint = fingerprint or model_fingerprint(path)
    if use_cache and (cached := read_weight_cache(cache, fingerprint)):
        return cached
    meta, weights = read_gguf(path)
    cfg = ModelConfig.from_gguf(meta, has_output_weight="lm_head.weight" in weights)
    if cfg.architecture == "LlamaForCausalLM":
        for name in list(weights):
            if name.endswith("q_proj.weight"):
                weights[name] = unpermute_rows(weights[name], cfg.num_heads)
            elif name.endswith("k_proj.weight"):
                weights[name] = unpermute_rows(weights[name], cfg.num_kv_heads)
    if use_cache:
        write_weight_cache(cache, fingerprint, cfg, weights, mode=path.stat().st_mode & 0o666)
    return cfg, weights


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """XXH3-128 over every tensor's name, dtype, shape and bytes: a cache that was damaged
    after it was written is refused, never served."""
    digest = xxhash.xxh3_128()
    for name in sorted(weights):
        t = weights[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        digest.update(memoryview(t.view(torch.uint8).numpy()))
    return digest.hexdigest()


def read_weight_cache(cache: Path, fingerprint: str) -> tuple[ModelConfig, dict[str, torch.Tensor]] | None:
    """The cached config and weights, or None when absent, unreadable, of another GGUF or damaged."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(cache), "pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") != WEIGHT_CACHE_FORMAT or meta.get("gguf") != fingerprint:
            return None
        weights = load_file(str(cache))
        if weights_digest(weights) != meta.get("digest"):
            return None
        return ModelConfig(**json.loads(meta["config"])), weights
    except Exception:  # missing, truncated or not safetensors at all: rebuild it
        return None


def write_weight_cache(cache: Path, fingerprint: str, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                       mode: int) -> None:
    """Write the cache in a temporary folder and rename it into place, so that a reader (or a
    second process building it at the same time) sees a whole file or none; ``mode``: readable
    by whoever may read the GGUF. A folder, because safetensors writes through a ``.tmpXXXXXX``
    file of its own beside its target: a writer killed midway leaves only our folder, which the
    next write removes (``engine.cachefiles``). A folder we may not write to only costs later
    loads their speed."""
    from safetensors.torch import save_file

    meta = {"format": WEIGHT_CACHE_FORMAT, "gguf": fingerprint, "digest": weights_digest(weights),
            "config": json.dumps(dataclasses.asdict(cfg))}
    remove_dead_temps(cache)
    tmp = temp_path(cache)
    try:
        tmp.mkdir()
        written = tmp / cache.name
        save_file(weights, written, metadata=meta)
        os.chmod(written, mode)
        os.replace(written, cache)
    except OSError:
        pass
    finally:
        remove(tmp)


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """GGUF metadata as plain values, and every tensor dequantised to float32 under its HF name."""
    from gguf import GGUFReader, dequantize

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueError/struct errors on bad files
        raise ValueError(f"{path} is not a readable GGUF file: {exc}") from exc
    meta = {}
    for key, fld in reader.fields.items():
        if key.startswith("GGUF.") or key in ("tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                                               "tokenizer.ggml.scores"):
            continue
        meta[key] = fld.contents()
    weights = {}
    for t in reader.tensors:
        array = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # a writable copy of the mmap
        weights[gguf_to_hf_name(t.name)] = torch.from_numpy(array)
    return meta, weights


def gguf_to_hf_name(name: str) -> str:
    if name in GGUF_NAMES:
        return GGUF_NAMES[name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in GGUF_LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return name


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation (interleaved pairs -> two halves)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
