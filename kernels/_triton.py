"""Optional Triton: the package must import and run its torch path where triton is absent."""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: every op falls back to its torch reference
    triton = None
    tl = None


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel can run: triton imports and every tensor is on CUDA."""
    return triton is not None and all(t.is_cuda for t in tensors)


def require_triton() -> None:
    """A clear error instead of a NameError when a ``*_triton`` op is called without triton."""
    if triton is None:
        raise RuntimeError("triton is not installed; use the torch reference or install kvstore[gpu]")


def next_pow2(n: int) -> int:
    """Triton block shapes must be powers of two; pad and mask up to this."""
    return 1 << max(0, int(n) - 1).bit_length()
