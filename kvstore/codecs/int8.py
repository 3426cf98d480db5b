"""Lossy codec: int8 with one fp32 scale per row (per token, head and K/V in a chunk).

Symmetric per-row quantisation keeps every value within ``max|row| / 254`` of the
original (before rounding to the output dtype), at a little over half of fp16's size.
Layout and bound: docs/codecs.md.
"""

from __future__ import annotations

import torch

from kernels.quant import dequantize_int8, quantize_int8
from kvstore.codecs.base import Codec
from kvstore.codecs.sections import Sections, pack, require_finite, rows_of


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [n, width]`` -> (``q`` int8 ``[n, width]``, ``scale`` fp32 ``[n]``)."""
    return quantize_int8(rows)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_int8(q, scale, dtype)


def check_scales(scale: torch.Tensor, codec: str) -> None:
    if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise ValueError(f"{codec} payload has a negative or non-finite scale")


class Int8Codec(Codec):
    name = "int8"
    codec_id = 2
    lossless = False

    def encode(self, tensor: torch.Tensor) -> bytes:
        require_finite(tensor, self.name)
        q, scale = quantize_rows(tensor.reshape(rows_of(tuple(tensor.shape))))
        return pack(q, scale)

    def decode_into(self, payload, out: torch.Tensor) -> None:
        rows, width = rows_of(tuple(out.shape))
        sections = Sections(payload, self.name)
        q = sections.take(rows * width, torch.int8).reshape(rows, width)
        scale = sections.take(rows, torch.float32)
        sections.finish()
        check_scales(scale, self.name)
        out.copy_(dequantize_rows(q, scale, out.dtype).reshape(out.shape))
