"""Attention over the paged KV cache for one flattened batch of prefill chunks and decodes.

The engine keeps ONE cache tensor for all layers, shaped
``[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]``; ``kv_cache[l]`` is vLLM's
per-layer ``[2, num_blocks, block_size, kv_heads, head_dim]`` and ``kv_cache[l, 0]`` /
``kv_cache[l, 1]`` are that layer's K and V caches. Token ``t`` of a sequence lives in slot
``block_table[t // block_size] * block_size + t % block_size``.

A step's tokens are flattened: first ``num_decodes`` decode tokens (one per sequence), then
each prefill chunk's tokens. New K/V are written with the kernels' ``reshape_and_cache``; the
decodes use paged decode attention; a prefill chunk attends to its cached prefix plus itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.cache_write import reshape_and_cache
from kernels.paged_attention import paged_decode_attention


@dataclass
class PrefillChunk:
    """``query_len`` new tokens at ``query_start`` in the flat batch; ``context_len`` counts them too."""

    query_start: int
    query_len: int
    context_len: int
    block_ids: torch.Tensor  # int64, blocks covering context_len tokens
    observe: int = 0  # record the attention of this many last queries over the context (see attention_mass)


@dataclass
class AttentionMetadata:
    """Where every token of a step goes in the cache and what it attends to."""

    slot_mapping: torch.Tensor  # [T] int64
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_context_lens: torch.Tensor | None = None  # [num_decodes] int32
    prefills: list[PrefillChunk] = field(default_factory=list)
    # For chunks with ``observe``: per layer call, one ``[context_len]`` tensor per such chunk,
    # the attention its last ``observe`` queries pay each context token, summed over them and
    # the heads (SnapKV's observation window; a prefill producer ranks tokens by it).
    attention_mass: list[list[torch.Tensor]] = field(default_factory=list)


def decode_attention_sdpa(query, k_cache, v_cache, block_tables, context_lens, scale):
    """CPU fast path with the same contract as ``paged_decode_attention``: one batched gather + SDPA."""
    batch, q_heads, head_dim = query.shape
    kv_heads = k_cache.shape[2]
    k = k_cache[block_tables.long()].reshape(batch, -1, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[block_tables.long()].reshape(batch, -1, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(k.shape[2], device=query.device)
    mask = (positions[None, :] < context_lens[:, None].to(query.device))[:, None, None, :]
    out = F.scaled_dot_product_attention(
        query[:, :, None, :], k.to(query.dtype), v.to(query.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


def paged_attention(q, k, v, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """``q`` ``[T, q_heads, D]``, ``k``/``v`` ``[T, kv_heads, D]``, ``kv_layer`` ``[2, blocks, bs, kv_heads, D]``."""
    k_cache, v_cache = kv_layer[0], kv_layer[1]
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        decode = paged_decode_attention if q.is_cuda else decode_attention_sdpa
        out[:nd] = decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    masses = []
    for chunk in meta.prefills:
        span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
        qs = q[span].transpose(0, 1)[None]
        if chunk.context_len == chunk.query_len:  # nothing cached before: attend to the fresh K/V
            ks, vs = k[span], v[span]
            mask = None
        else:
            ks = k_cache[chunk.block_ids].flatten(0, 1)[: chunk.context_len].to(q.dtype)
            vs = v_cache[chunk.block_ids].flatten(0, 1)[: chunk.context_len].to(q.dtype)
            first = chunk.context_len - chunk.query_len
            rows = torch.arange(first, chunk.context_len, device=q.device)[:, None]
            mask = torch.arange(chunk.context_len, device=q.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(
            qs, ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True,
        )
        out[span] = o[0].transpose(0, 1)
        if chunk.observe:
            masses.append(observed_mass(qs[0], ks, chunk.context_len,
                                        min(chunk.observe, chunk.query_len), scale))
    if masses:
        meta.attention_mass.append(masses)
    return out


def observed_mass(q: torch.Tensor, k: torch.Tensor, context_len: int, window: int, scale: float) -> torch.Tensor:
    """``q`` ``[q_heads, query_len, D]`` (the chunk's queries, the last at ``context_len - 1``),
    ``k`` ``[context_len, kv_heads, D]`` -> ``[context_len]``: the causal attention of the last
    ``window`` queries over the context, summed over them and the heads."""
    qw = q[:, -window:].float()
    keys = k.float().transpose(0, 1).repeat_interleave(q.shape[0] // k.shape[1], dim=0)
    scores = qw @ keys.transpose(1, 2) * scale
    rows = torch.arange(context_len - window, context_len, device=q.device)[:, None]
    scores = scores.masked_fill(torch.arange(context_len, device=q.device)[None, :] > rows, float("-inf"))
    return scores.softmax(-1).sum(dim=(0, 1))
