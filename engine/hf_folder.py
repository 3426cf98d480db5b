"""SmolLM2-135M-Instruct as a Hugging Face folder, for engines that cannot read GGUF (vLLM 0.32
has no GGUF loader). Converted once from the GGUF of ``engine.assets`` with transformers (which
dequantizes Q4_1 on load) and cached beside it under the model cache.

    python -m engine.hf_folder        # prints the folder, converting on first use (about 2 min)

The weights are saved in fp32: what the GGUF dequantizes to, so vLLM (run in fp32 on CPUs
without native bf16) computes on the same numbers as the bundled engine.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from engine.assets import model_cache_dir, smollm2_gguf_path


def smollm2_hf_path() -> Path:
    """The folder (config.json, model.safetensors, tokenizer files), converting on first use."""
    target = model_cache_dir() / "smollm2-135m-instruct-hf-fp32"
    if (target / "config.json").exists():
        return target
    gguf = smollm2_gguf_path()
    print(f"converting {gguf.name} into an HF folder at {target} (once)", file=sys.stderr, flush=True)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model marked GGUF-quantized; its weights are dequantized already
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        model.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        os.replace(partial, target)  # the folder appears complete or not at all
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


if __name__ == "__main__":
    print(smollm2_hf_path())
