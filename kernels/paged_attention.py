"""Paged decode attention with grouped-query heads: one new query token per sequence.

Cache layout per layer: ``k_cache``/``v_cache`` are ``[num_blocks, block_size, kv_heads,
head_dim]`` (the two halves of vLLM's ``[2, num_blocks, block_size, kv_heads, head_dim]``).
Sequence ``b`` owns blocks ``block_tables[b, :ceil(context_lens[b] / block_size)]``.
"""

from __future__ import annotations

import math

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton

_LOG2E = math.log2(math.e)
# Cached tokens per loop step: several 16-token blocks in flight per step hide memory latency
# better than one; any block size works because each token finds its own block.
_TILE_TOKENS = 64


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


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, lens_ptr,
        qk_scale,  # softmax scale * log2(e): the kernel works in base 2
        stride_qb, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_ob, stride_oh,
        stride_tb,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PAD_G: tl.constexpr, PAD_D: tl.constexpr, TILE_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """One program per (sequence, kv head): its query group against every cached token."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        rows = tl.arange(0, PAD_G)
        dims = tl.arange(0, PAD_D)
        row_ok = rows < GROUP
        dim_ok = dims < HEAD_DIM
        q_heads = kv_head * GROUP + rows
        q = tl.load(
            q_ptr + b * stride_qb + q_heads[:, None] * stride_qh + dims[None, :],
            mask=row_ok[:, None] & dim_ok[None, :], other=0.0,
        ).to(tl.float32)
        q = q * qk_scale
        ctx = tl.load(lens_ptr + b)
        m_i = tl.full([PAD_G], float("-inf"), tl.float32)
        l_i = tl.zeros([PAD_G], tl.float32)
        acc = tl.zeros([PAD_G, PAD_D], tl.float32)
        for start in range(0, ctx, TILE_N):
            tokens = start + tl.arange(0, TILE_N)
            tok_ok = tokens < ctx
            block = tl.load(tables_ptr + b * stride_tb + tokens // BLOCK_SIZE, mask=tok_ok, other=0).to(tl.int64)
            offset = tokens % BLOCK_SIZE
            kv_mask = tok_ok[:, None] & dim_ok[None, :]
            k = tl.load(
                k_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
                mask=kv_mask, other=0.0,
            ).to(tl.float32)
            v = tl.load(
                v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
                mask=kv_mask, other=0.0,
            ).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
            s = tl.where(tok_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # an empty context yields zeros, as the reference
        tl.store(
            out_ptr + b * stride_ob + q_heads[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


def paged_decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton: same contract as the reference. The query group is padded to 16 rows so
    ``tl.dot`` gets shapes a GPU accepts; K/V are upcast to fp32 right after loading (half
    values are exact in tf32, so half caches keep tensor-core dots; fp32 caches use exact ones)."""
    require_triton()
    batch, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    group = q_heads // kv_heads
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    out = torch.empty_like(query)
    if batch == 0:
        return out
    precision = "ieee" if k_cache.dtype == torch.float32 or v_cache.dtype == torch.float32 else "tf32"
    _paged_decode_kernel[(batch, kv_heads)](
        query, k_cache, v_cache, out, block_tables, context_lens,
        scale * _LOG2E,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PAD_G=max(16, next_pow2(group)), PAD_D=max(16, next_pow2(head_dim)),
        TILE_N=max(_TILE_TOKENS, next_pow2(block_size)),
        PRECISION=precision,
    )
    return out


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(query, k_cache, v_cache, block_tables, context_lens):
        return paged_decode_attention_triton(query, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_torch(query, k_cache, v_cache, block_tables, context_lens, scale)
