"""Tiny random Llama-family checkpoints (HF folder layout) for tests and ``kvbench engine --quick``,
and transformers' float32 reference of a real checkpoint.

Made with transformers at run time, so nothing is downloaded; the tokenizer is byte-level
BPE without merges (every byte is a token) plus ``<s>``/``</s>``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from engine.cachefiles import remove, remove_dead_temps, temp_path

NUM_BYTES = 256
BOS, EOS = NUM_BYTES, NUM_BYTES + 1
VOCAB = 260


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab.update({"<s>": BOS, "</s>": EOS})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<s>", "</s>"])
    return tok


def make_tiny_checkpoint(folder: str | Path, architecture: str = "llama", seed: int = 0, num_layers: int = 2,
                         tie_word_embeddings: bool = True, max_position_embeddings: int = 512) -> Path:
    """Save a random model of ``architecture`` ('llama', 'qwen2' or 'qwen3') with a tokenizer."""
    import torch
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    if architecture not in classes:
        raise ValueError(f"unknown tiny architecture {architecture!r}; choose one of {sorted(classes)}")
    config_cls, model_cls = classes[architecture]
    config = config_cls(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=BOS, eos_token_id=EOS, rms_norm_eps=1e-6,
        initializer_range=0.3,  # large enough that greedy outputs vary with the context
    )
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0; perturb them so they matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    folder = Path(folder)
    model.save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    template = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}" \
               "{% if add_generation_prompt %}<s>assistant: {% endif %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<s>", "eos_token": "</s>"}))
    return folder


def transformers_reference(model_path: str | Path):
    """The same checkpoint loaded by transformers in float32, as the reference to compare against
    (a GGUF through ``transformers_copy``)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model_path)
    folder = path if path.is_dir() else transformers_copy(path)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def transformers_copy(gguf: Path) -> Path:
    """An HF folder (config, float32 safetensors, tokenizer) of what transformers' own GGUF
    loader makes of ``gguf``, which then loads in seconds instead of ~25 (that loader parses
    the whole file in Python). Kept beside it as ``<file>.transformers-<fingerprint>`` (in the
    model cache if that folder is read-only), named by the weights' content so another GGUF
    at that path never finds it, and built in a temporary folder renamed into place, so a
    folder there is whole. Its manifest of file sizes, written last, says it still is: one
    cut short or damaged since (or made before manifests) is rebuilt, never loaded as is."""
    import torch
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.assets import model_cache_dir
    from engine.models.loader import model_fingerprint

    digest = model_fingerprint(gguf).rsplit("-", 1)[1]
    parent = gguf.parent if os.access(gguf.parent, os.W_OK) else model_cache_dir()
    folder = parent / f"{gguf.name}.transformers-{digest}"
    if copy_is_whole(folder):
        return folder
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temps(folder)
    tmp = temp_path(folder)
    try:
        tmp.mkdir()
        save_model(model, f"{tmp}/model.safetensors")  # save_pretrained refuses "gguf-quantized" models
        model.config.quantization_config = None
        model.config.to_json_file(f"{tmp}/config.json")
        tokenizer.save_pretrained(tmp)
        for f in tmp.iterdir():  # safetensors writes 0600: a shared cache is read by other users too
            f.chmod(0o644)
        sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir())}
        (tmp / COPY_MANIFEST).write_text(json.dumps(sizes))
        tmp.chmod(0o755)
        if folder.exists() and not copy_is_whole(folder):
            aside = temp_path(folder)
            with contextlib.suppress(FileNotFoundError):  # another process moved it first
                folder.rename(aside)
            remove(aside)
        try:
            tmp.rename(folder)
        except OSError:  # another process renamed its copy there first
            if not copy_is_whole(folder):
                raise
    finally:
        remove(tmp)
    if parent == gguf.parent:
        remove_superseded_copies(folder, gguf)
    return folder


COPY_MANIFEST = "manifest.json"


def copy_is_whole(folder: Path) -> bool:
    """Whether ``folder`` holds every file its manifest lists, at the size listed: a check
    that costs no read of the weights and catches a copy cut short."""
    try:
        sizes = json.loads((folder / COPY_MANIFEST).read_text())
        return all((folder / name).stat().st_size == size for name, size in sizes.items())
    except (OSError, ValueError, AttributeError):  # no manifest, a file gone, or a manifest damaged
        return False


def remove_superseded_copies(folder: Path, gguf: Path) -> None:
    """Remove the copies beside ``gguf`` that no load reads again (~500 MB each): of content
    the GGUF at this path had before, and the unverified ``<file>.transformers-fp32`` of an
    earlier version. Only beside the GGUF: in the shared model cache a name like ours may be
    the copy of a GGUF of the same file name in another folder."""
    pattern = re.compile(rf"{re.escape(gguf.name)}\.transformers-(fp32|[0-9a-f]{{16}})")
    for entry in folder.parent.iterdir():
        if entry != folder and pattern.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            remove(entry)
