"""Move whole engine blocks between the paged KV cache and a contiguous chunk buffer.

The engine keeps one cache tensor for all layers, ``[num_layers, 2, num_blocks,
block_size, kv_heads, head_dim]``; a store chunk is ``[num_layers, 2, n * block_size,
kv_heads, head_dim]`` for ``n`` blocks, so one call moves every layer at once.
"""

from __future__ import annotations

import torch


def gather_blocks_torch(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: copy blocks ``block_ids`` (in order) of every layer into a chunk tensor."""
    layers, two, _, block_size, heads, dim = kv_cache.shape
    n = block_ids.numel()
    gathered = kv_cache[:, :, block_ids.long()].reshape(layers, two, n * block_size, heads, dim)
    if out is None:
        return gathered
    out.copy_(gathered)
    return out


def scatter_blocks_torch(chunk: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Reference: the inverse of ``gather_blocks``: write a chunk into blocks ``block_ids``."""
    layers, two, _, block_size, heads, dim = kv_cache.shape
    n = block_ids.numel()
    kv_cache[:, :, block_ids.long()] = chunk.reshape(layers, two, n, block_size, heads, dim).to(kv_cache.dtype)


def gather_blocks(kv_cache, block_ids, out=None):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    return gather_blocks_torch(kv_cache, block_ids, out)


def scatter_blocks(chunk, kv_cache, block_ids) -> None:
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    scatter_blocks_torch(chunk, kv_cache, block_ids)
