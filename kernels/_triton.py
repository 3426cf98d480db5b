"""Optional Triton, loaded only where a kernel can run: the package must import and run its
torch path where triton is absent, or where no kernel could run (a CPU machine: there
importing triton only cost every process ~73 MB of memory and ~70 ms, a daemon included)."""

from __future__ import annotations

import os
import sys

import torch


def _wanted() -> bool:
    """A CUDA device, the interpreter (TRITON_INTERPRET=1: tests run the kernels on CPU
    tensors), or a process that imported triton itself (compiling ahead of time)."""
    return "triton" in sys.modules or os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()


triton = tl = None
if _wanted():
    try:
        import triton
        import triton.language as tl
    except ImportError:  # CPU-only installs: every op falls back to its torch reference
        triton = tl = None


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when the Triton kernel can run: triton is loaded and every tensor is on CUDA."""
    return triton is not None and all(t.is_cuda for t in tensors)


def require_triton() -> None:
    """A clear error instead of a NameError when a ``*_triton`` op is called without triton."""
    if triton is None:
        raise RuntimeError("triton is not loaded (not installed, or no CUDA device and TRITON_INTERPRET unset); "
                           "use the torch reference or install kvstore[gpu]")


def next_pow2(n: int) -> int:
    """Triton block shapes must be powers of two; pad and mask up to this."""
    return 1 << max(0, int(n) - 1).bit_length()
