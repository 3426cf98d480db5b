"""Write new tokens' K and V into the paged cache at given slots (slot = block * block_size + offset).

A slot of -1 means "do not write" (padding tokens).
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton


def reshape_and_cache_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Reference: ``key``/``value`` ``[T, kv_heads, D]``; caches ``[num_blocks, block_size, kv_heads, D]``."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat[slots] = key[keep].to(k_cache.dtype)
    v_flat[slots] = value[keep].to(v_cache.dtype)


if triton is not None:

    @triton.jit
    def _cache_write_kernel(
        key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slots_ptr,
        stride_kt, stride_kh, stride_vt, stride_vh,
        stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
        KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PAD_H: tl.constexpr, PAD_D: tl.constexpr,
    ):
        """One program per token: all its kv heads in one masked tile; slot -1 stores nothing."""
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        heads = tl.arange(0, PAD_H)[:, None]
        dims = tl.arange(0, PAD_D)[None, :]
        mask = (heads < KV_HEADS) & (dims < HEAD_DIM) & (heads * 0 + slot >= 0)  # the interpreter needs a tensor here
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        k = tl.load(key_ptr + t * stride_kt + heads * stride_kh + dims, mask=mask)
        v = tl.load(value_ptr + t * stride_vt + heads * stride_vh + dims, mask=mask)
        tl.store(
            k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims,
            k.to(k_cache_ptr.dtype.element_ty), mask=mask,
        )
        tl.store(
            v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims,
            v.to(v_cache_ptr.dtype.element_ty), mask=mask,
        )


def reshape_and_cache_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Triton: same contract as the reference; one launch writes every token of the step."""
    require_triton()
    tokens, kv_heads, head_dim = key.shape
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    if tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()  # the kernel reads token t's slot at slots_ptr + t
    _cache_write_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        KV_HEADS=kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        PAD_H=next_pow2(kv_heads), PAD_D=next_pow2(head_dim),
    )


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(key, value, k_cache, v_cache, slot_mapping):
        reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    else:
        reshape_and_cache_torch(key, value, k_cache, v_cache, slot_mapping)
