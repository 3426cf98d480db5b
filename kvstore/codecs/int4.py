"""Lossy codec: int4, asymmetric, with an fp32 scale and zero point per group of 32 values.

Groups run along the last dimension (head_dim). A width that is not a multiple of 32 is
padded by repeating the row's last value, which leaves every group's range unchanged.
Each value ends within ``(max - min of its group) / 30`` of the original (before rounding
to the output dtype). Layout and bound: docs/codecs.md.
"""

from __future__ import annotations

import torch

from kernels.quant import dequantize_int4, quantize_int4
from kvstore.codecs.base import Codec
from kvstore.codecs.sections import LARGEST, Sections, pack, require_finite, rows_of

GROUP = 32


def padded_width(width: int) -> int:
    return -(-width // GROUP) * GROUP


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows [n, width]`` -> (``packed`` uint8 ``[n, W/2]``, ``scale``, ``zero`` fp32 ``[n, W/32]``),
    ``W`` being the width padded to whole groups. Fails on a range near or beyond fp32's largest."""
    pad = padded_width(rows.shape[1]) - rows.shape[1]
    if pad:
        rows = torch.cat((rows, rows[:, -1:].expand(-1, pad)), dim=1)
    packed, scale, zero = quantize_int4(rows, GROUP)
    if not bool((scale <= LARGEST / 15).all()):  # 15 x scale + zero stays finite when decoded
        raise ValueError("int4 cannot encode a group whose range comes within 2**-20 of fp32's largest value")
    return packed, scale, zero


def dequantize_rows(packed, scale, zero, width: int, dtype: torch.dtype) -> torch.Tensor:
    """The ``[n, width]`` rows that ``quantize_rows`` encoded."""
    if not bool((torch.isfinite(scale) & (scale >= 0) & torch.isfinite(zero)).all()):
        raise ValueError("int4 payload has a negative or non-finite scale or zero point")
    return dequantize_int4(packed, scale, zero, GROUP, dtype)[:, :width]


class Int4Codec(Codec):
    name = "int4"
    codec_id = 3
    lossless = False

    def encode(self, tensor: torch.Tensor) -> bytes:
        require_finite(tensor, self.name)
        return pack(*quantize_rows(tensor.reshape(rows_of(tuple(tensor.shape)))))

    def decode_into(self, payload, out: torch.Tensor) -> None:
        rows, width = rows_of(tuple(out.shape))
        padded = padded_width(width)
        sections = Sections(payload, self.name)
        packed = sections.take(rows * padded // 2, torch.uint8).reshape(rows, padded // 2)
        scale = sections.take(rows * padded // GROUP, torch.float32).reshape(rows, padded // GROUP)
        zero = sections.take(rows * padded // GROUP, torch.float32).reshape(rows, padded // GROUP)
        sections.finish()
        out.copy_(dequantize_rows(packed, scale, zero, width, out.dtype).reshape(out.shape))
