"""Integer quantisation of KV along the last dimension (head_dim).

- int8: symmetric, one fp32 scale per row (per token and head): ``x ~= q * scale``.
- int4: asymmetric, one fp32 scale and zero point per group of ``group_size`` values:
  ``x ~= q * scale + zero`` with ``q`` in 0..15, two values per byte (low nibble first).

Both round to nearest (ties to even), so a dequantised value is within half a step of its
input, ``|x - x'| <= scale / 2``, plus the output dtype's own rounding. The Triton kernels
return the same quantised bytes, scales and zeros as the references run on CPU, bit for bit.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton


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
    g = q.reshape(*lead, half * 2 // group_size, group_size)
    return (g * scale.unsqueeze(-1) + zero.unsqueeze(-1)).reshape(*lead, half * 2).to(dtype)


if triton is not None:

    @triton.jit
    def _round_half_even(y):
        """``torch.round`` (ties to even) from exact steps: libdevice's rint has no interpreter twin."""
        a = tl.abs(y)
        r = tl.floor(a)
        frac = a - r
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((frac > 0.5) | ((frac == 0.5) & odd), r + 1.0, r)
        return tl.where(y < 0, -r, r)

    @triton.jit
    def _quantize_int8_kernel(
        x_ptr, q_ptr, scale_ptr, rows, DIM: tl.constexpr, BLOCK_R: tl.constexpr, PAD_D: tl.constexpr
    ):
        """A tile of ``BLOCK_R`` rows; IEEE divisions (``div_rn``) keep it bit-identical to torch on CPU."""
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, PAD_D)
        mask = (r < rows)[:, None] & (d < DIM)[None, :]
        x = tl.load(x_ptr + r[:, None] * DIM + d[None, :], mask=mask, other=0.0).to(tl.float32)
        scale = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        q = _round_half_even(tl.math.div_rn(x, safe[:, None]))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(q_ptr + r[:, None] * DIM + d[None, :], q.to(tl.int8), mask=mask)
        tl.store(scale_ptr + r, scale, mask=r < rows)

    @triton.jit
    def _dequantize_int8_kernel(
        q_ptr, scale_ptr, out_ptr, rows, DIM: tl.constexpr, BLOCK_R: tl.constexpr, PAD_D: tl.constexpr
    ):
        r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        d = tl.arange(0, PAD_D)
        mask = (r < rows)[:, None] & (d < DIM)[None, :]
        q = tl.load(q_ptr + r[:, None] * DIM + d[None, :], mask=mask, other=0).to(tl.float32)
        scale = tl.load(scale_ptr + r, mask=r < rows, other=0.0)
        tl.store(out_ptr + r[:, None] * DIM + d[None, :], (q * scale[:, None]).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _quantize_int4_kernel(
        x_ptr, packed_ptr, scale_ptr, zero_ptr, groups,
        GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, PAD_PAIRS: tl.constexpr,
    ):
        """A tile of ``BLOCK_G`` groups (x seen as ``[groups, group_size]``), one row per group and
        one column per (even, odd) pair, so a pair packs into one byte without reshaping."""
        g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        i = tl.arange(0, PAD_PAIRS)
        g_ok = g < groups
        mask = g_ok[:, None] & (i < GROUP_SIZE // 2)[None, :]
        at = x_ptr + g[:, None] * GROUP_SIZE + 2 * i[None, :]
        even = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        odd = tl.load(at + 1, mask=mask, other=0.0).to(tl.float32)
        lo = tl.min(tl.where(mask, tl.minimum(even, odd), float("inf")), axis=1)
        hi = tl.max(tl.where(mask, tl.maximum(even, odd), float("-inf")), axis=1)
        lo = tl.where(g_ok, lo, 0.0)
        hi = tl.where(g_ok, hi, 0.0)
        scale = tl.math.div_rn(hi - lo, 15.0)
        safe = tl.where(scale > 0, scale, 1.0)[:, None]
        q_even = _round_half_even(tl.math.div_rn(even - lo[:, None], safe))
        q_odd = _round_half_even(tl.math.div_rn(odd - lo[:, None], safe))
        q_even = tl.minimum(tl.maximum(q_even, 0.0), 15.0).to(tl.uint8)
        q_odd = tl.minimum(tl.maximum(q_odd, 0.0), 15.0).to(tl.uint8)
        tl.store(packed_ptr + g[:, None] * (GROUP_SIZE // 2) + i[None, :], q_even | (q_odd << 4), mask=mask)
        tl.store(scale_ptr + g, scale, mask=g_ok)
        tl.store(zero_ptr + g, lo, mask=g_ok)

    @triton.jit
    def _dequantize_int4_kernel(
        packed_ptr, scale_ptr, zero_ptr, out_ptr, groups,
        GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, PAD_PAIRS: tl.constexpr,
    ):
        g = tl.program_id(0).to(tl.int64) * BLOCK_G + tl.arange(0, BLOCK_G)
        i = tl.arange(0, PAD_PAIRS)
        g_ok = g < groups
        mask = g_ok[:, None] & (i < GROUP_SIZE // 2)[None, :]
        packed = tl.load(packed_ptr + g[:, None] * (GROUP_SIZE // 2) + i[None, :], mask=mask, other=0)
        scale = tl.load(scale_ptr + g, mask=g_ok, other=0.0)[:, None]
        zero = tl.load(zero_ptr + g, mask=g_ok, other=0.0)[:, None]
        even = (packed & 0xF).to(tl.float32) * scale + zero
        odd = (packed >> 4).to(tl.float32) * scale + zero
        at = out_ptr + g[:, None] * GROUP_SIZE + 2 * i[None, :]
        tl.store(at, even.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(at + 1, odd.to(out_ptr.dtype.element_ty), mask=mask)


# Rows (int8) or groups (int4) per program: enough work per program on a GPU, few under the interpreter.
_ROWS_PER_PROGRAM = 16
# Separate multiply and add as torch does (no FMA), so results match the reference bit for bit.
_NO_FMA = {"enable_fp_fusion": False}


def _launch_rows(n: int) -> tuple[int, tuple[int]]:
    block = min(_ROWS_PER_PROGRAM, next_pow2(max(n, 1)))
    return block, (triton.cdiv(n, block),)


def quantize_int8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton: same contract and, bit for bit, the same output as the reference on CPU."""
    require_triton()
    dim = x.shape[-1]
    flat = x.reshape(-1, dim).contiguous()
    q = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if flat.shape[0]:
        block, grid = _launch_rows(flat.shape[0])
        _quantize_int8_kernel[grid](
            flat, q, scale, flat.shape[0], DIM=dim, BLOCK_R=block, PAD_D=next_pow2(dim), **_NO_FMA
        )
    return q, scale


def dequantize_int8_triton(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    require_triton()
    dim = q.shape[-1]
    flat = q.reshape(-1, dim).contiguous()
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    if flat.shape[0]:
        block, grid = _launch_rows(flat.shape[0])
        _dequantize_int8_kernel[grid](
            flat, scale.contiguous(), out, flat.shape[0], DIM=dim, BLOCK_R=block, PAD_D=next_pow2(dim), **_NO_FMA
        )
    return out


def quantize_int4_triton(x: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton: same contract and, bit for bit, the same output as the reference on CPU."""
    require_triton()
    *lead, dim = x.shape
    if dim % group_size or group_size % 2:
        raise ValueError(f"last dim {dim} must be a multiple of an even group_size {group_size}")
    flat = x.contiguous()
    groups = x.numel() // group_size
    packed = torch.empty((*lead, dim // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*lead, dim // group_size), dtype=torch.float32, device=x.device)
    zero = torch.empty_like(scale)
    if groups:
        block, grid = _launch_rows(groups)
        _quantize_int4_kernel[grid](
            flat, packed, scale, zero, groups,
            GROUP_SIZE=group_size, BLOCK_G=block, PAD_PAIRS=next_pow2(group_size // 2), **_NO_FMA,
        )
    return packed, scale, zero


def dequantize_int4_triton(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    require_triton()
    *lead, half = packed.shape
    groups = packed.numel() * 2 // group_size
    out = torch.empty((*lead, half * 2), dtype=dtype, device=packed.device)
    if groups:
        block, grid = _launch_rows(groups)
        _dequantize_int4_kernel[grid](
            packed.contiguous(), scale.contiguous(), zero.contiguous(), out, groups,
            GROUP_SIZE=group_size, BLOCK_G=block, PAD_PAIRS=next_pow2(group_size // 2), **_NO_FMA,
        )
    return out


def quantize_int8(x):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    return quantize_int8_triton(x) if use_triton(x) else quantize_int8_torch(x)


def dequantize_int8(q, scale, dtype):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    return dequantize_int8_triton(q, scale, dtype) if use_triton(q, scale) else dequantize_int8_torch(q, scale, dtype)


def quantize_int4(x, group_size: int = 32):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    return quantize_int4_triton(x, group_size) if use_triton(x) else quantize_int4_torch(x, group_size)


def dequantize_int4(packed, scale, zero, group_size, dtype):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(packed, scale, zero):
        return dequantize_int4_triton(packed, scale, zero, group_size, dtype)
    return dequantize_int4_torch(packed, scale, zero, group_size, dtype)
