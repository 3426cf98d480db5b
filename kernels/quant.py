"""Integer quantisation of KV along the last dimension (head_dim).

- int8: symmetric, one fp32 scale per row (per token and head): ``x ~= q * scale``.
- int4: asymmetric, one fp32 scale and zero point per group of ``group_size`` values:
  ``x ~= q * scale + zero`` with ``q`` in 0..15, two values per byte (low nibble first).
"""

from __future__ import annotations

import torch


def quantize_int8_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., D]`` -> (``q`` int8 ``[..., D]``, ``scale`` fp32 ``[...]``)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / safe.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8_torch(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def quantize_int4_torch(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x [..., D]`` (D divisible by ``group_size``, which is even) ->
    (``packed`` uint8 ``[..., D // 2]``, ``scale`` and ``zero`` fp32 ``[..., D // group_size]``)."""
    *lead, dim = x.shape
    if dim % group_size or group_size % 2:
        raise ValueError(f"last dim {dim} must be a multiple of an even group_size {group_size}")
    g = x.float().reshape(*lead, dim // group_size, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    scale = (hi - lo) / 15.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - lo.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15).to(torch.uint8)
    q = q.reshape(*lead, dim)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed, scale, lo


def dequantize_int4_torch(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    *lead, half = packed.shape
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, half * 2).float()
    g = q.reshape(*lead, -1, group_size)
    return (g * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(*lead, half * 2).to(dtype)


def quantize_int8(x):
    return quantize_int8_torch(x)


def dequantize_int8(q, scale, dtype):
    return dequantize_int8_torch(q, scale, dtype)


def quantize_int4(x, group_size: int = 32):
    return quantize_int4_torch(x, group_size)


def dequantize_int4(packed, scale, zero, group_size, dtype):
    return dequantize_int4_torch(packed, scale, zero, group_size, dtype)
