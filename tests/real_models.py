"""The real SmolLM2-135M engine, loaded once per test process and shared by the modules that
run it (a load reads the GGUF's float32 weight cache, or builds it: about 10 s on two cores
the first time, paid once instead of once per module).

Each caller gets ``with_config``'s engine: the same weights and tokenizer (never written),
its own KV cache, block manager, scheduler and connector. Close it when done; the shared
base engine has no store and stays open for the process."""

from __future__ import annotations

import functools

from engine import LLM, EngineConfig
from engine.assets import smollm2_gguf_path


@functools.cache
def _base() -> LLM:
    return LLM(smollm2_gguf_path(), EngineConfig(num_blocks=4, block_size=16, dtype="float32"))


def smollm2(num_blocks: int, block_size: int = 16, **config) -> LLM:
    """A fresh float32 SmolLM2 engine of ``num_blocks`` blocks on the shared weights."""
    return _base().with_config(num_blocks=num_blocks, block_size=block_size, **config)
