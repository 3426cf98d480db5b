"""Reading and writing a payload as consecutive typed arrays, with exact length checks.

Lossy payloads are a version byte followed by arrays whose sizes follow from the blob's
shape, so a truncated or padded payload is always caught before anything is decoded.
"""

from __future__ import annotations

import numpy as np
import torch

VERSION = 1


def pack(*arrays: torch.Tensor) -> bytes:
    """The version byte followed by each contiguous CPU tensor's bytes."""
    parts = [bytes([VERSION])]
    parts += [t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in arrays]
    return b"".join(parts)


class Sections:
    """Takes typed arrays off the front of a payload written by ``pack``."""

    def __init__(self, payload: bytes | memoryview, codec: str):
        self._view = memoryview(payload).cast("B")
        self._codec = codec
        if len(self._view) < 1:
            raise ValueError(f"{codec} payload is empty")
        if self._view[0] != VERSION:
            raise ValueError(f"{codec} payload has version {self._view[0]}, expected {VERSION}")
        self._pos = 1

    def take(self, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The next ``count`` elements of ``dtype`` (a copy, so callers may write to it)."""
        size = count * torch.empty((), dtype=dtype).element_size()
        if self._pos + size > len(self._view):
            raise ValueError(f"{self._codec} payload is truncated")
        if size == 0:
            return torch.empty(0, dtype=dtype)
        raw = np.frombuffer(self._view, dtype=np.uint8, count=size, offset=self._pos)
        self._pos += size
        return torch.from_numpy(raw.copy()).view(dtype)

    def finish(self) -> None:
        """Fail if bytes are left over (a payload for a different shape or a garbled one)."""
        if self._pos != len(self._view):
            raise ValueError(f"{self._codec} payload has {len(self._view) - self._pos} bytes too many")


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, width)``: a tensor of ``shape`` seen as rows along its last dimension
    (an empty tensor is zero rows of width 1, so quantisers never reduce an empty row)."""
    width = shape[-1] if shape and shape[-1] else 1
    return int(np.prod(shape, dtype=np.int64)) // width, width


# Lossy codecs decode ``q * scale (+ zero)`` in fp32, rounded: for a value within a few ulps
# of fp32's largest finite number that rounds past it, to inf. They refuse such values.
LARGEST = float(torch.finfo(torch.float32).max) * (1 - 2**-20)


def require_finite(tensor: torch.Tensor, codec: str) -> None:
    """Lossy codecs quantise against a row's range, which NaN or inf would poison, and values
    beyond ``LARGEST`` would decode to inf."""
    if not tensor.is_floating_point():
        raise ValueError(f"{codec} encodes floating-point tensors, not {tensor.dtype}")
    if tensor.numel():
        lo, hi = torch.aminmax(tensor)
        if not -LARGEST <= float(lo) <= float(hi) <= LARGEST:  # NaN fails every comparison
            raise ValueError(f"{codec} cannot encode NaN, inf, or values within 2**-20 of fp32's largest; "
                             "use a lossless codec")
