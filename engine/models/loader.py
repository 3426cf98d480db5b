"""Load a Llama-family checkpoint: an HF folder (config.json + safetensors) or one GGUF file.

GGUF tensors are dequantised to float32 with the ``gguf`` package and renamed to HF names.
llama.cpp's converter permutes the rows of Llama's Q and K projections (interleaved rotary
pairs); we undo that so one model with HF's rotate-half RoPE serves both formats.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import torch
import xxhash

from engine.config import DTYPES, ModelConfig
from engine.models.llama import LlamaForCausalLM

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
    """A short name for the weights ``path`` holds: the file or folder name plus a digest of
    every weight file's name, size and whole content. Two checkpoints that differ anywhere
    (another quantisation, another random seed, a fine-tune of a few middle layers) get
    different names, so their KV never mixes in a store. (A digest of each file's first and
    last MiB only gave a checkpoint edited in between the other's name, and its KV.) The
    content goes through XXH3-128, which runs at memory speed: the load reads every byte anyway."""
    p = resolve_model_path(path)
    files = [p] if p.is_file() else sorted([*p.glob("*.safetensors"), p / "config.json"])
    digest = hashlib.blake2b(digest_size=8)
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}:{size}".encode())
        content = xxhash.xxh3_128()
        with open(f, "rb") as fh:
            while block := fh.read(8 << 20):
                content.update(block)
        digest.update(content.digest())
    return f"{p.name}-{digest.hexdigest()}"


def load_model(path: str | Path, dtype: str | None = None, device: str = "cpu") -> LlamaForCausalLM:
    """Build the model for ``path`` and load its weights; ``dtype`` None keeps the checkpoint's."""
    p = resolve_model_path(path)
    if p.is_dir():
        cfg = ModelConfig.from_hf(json.loads((p / "config.json").read_text()))
        weights = read_safetensors(p)
    else:
        meta, weights = read_gguf(p)
        cfg = ModelConfig.from_gguf(meta, has_output_weight="lm_head.weight" in weights)
        if cfg.architecture == "LlamaForCausalLM":
            for name in list(weights):
                if name.endswith("q_proj.weight"):
                    weights[name] = unpermute_rows(weights[name], cfg.num_heads)
                elif name.endswith("k_proj.weight"):
                    weights[name] = unpermute_rows(weights[name], cfg.num_kv_heads)
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
