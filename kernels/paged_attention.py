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
# Cached tokens x head dim loaded per loop step (64 x 128, 128 x 64). Several blocks per step
# keep more loads in flight; any block size works because each token finds its own block. On
# an H200 (Triton 3.6, 4 warps, 3 stages) 8192 read llama-8b-shaped KV at 0.74-0.80 of peak
# against 0.43-0.44 with 2048 (16 x 128 tiles, which fit in registers); a sweep of 2 and 4
# warps, 3-5 stages and 2048, 4096, 8192 found nothing better (docs/benchmarks.md "On a GPU").
_TILE_ELEMENTS = 8192


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
    def _paged_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, m_ptr, l_ptr, acc_ptr,
        qk_scale,  # softmax scale * log2(e): the kernel works in base 2
        split_tokens,  # cached tokens per split, a multiple of TILE_N
        splits,  # a runtime value: a constexpr would compile a variant per batch size
        stride_qb, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh,
        stride_tb,
        Q_HEADS: tl.constexpr,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        PAD_G: tl.constexpr, PAD_D: tl.constexpr, TILE_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Program (sequence, kv head, split): the whole query group against one contiguous
        range of cached tokens, online softmax over ``TILE_N``-token steps; writes the range's
        running max ``m``, denominator ``l`` and unnormalised output ``acc`` for the combine."""
        b = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
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
        start = split * split_tokens
        end = tl.minimum(start + split_tokens, tl.load(lens_ptr + b))
        m_i = tl.full([PAD_G], float("-inf"), tl.float32)
        l_i = tl.zeros([PAD_G], tl.float32)
        acc = tl.zeros([PAD_G, PAD_D], tl.float32)
        for tile in range(start, end, TILE_N):
            tokens = tile + tl.arange(0, TILE_N)
            tok_ok = tokens < end
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
        part = (b * Q_HEADS + q_heads) * splits + split  # partials are [B, q_heads, splits]
        tl.store(m_ptr + part, m_i, mask=row_ok)
        tl.store(l_ptr + part, l_i, mask=row_ok)
        tl.store(acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_ok[:, None] & dim_ok[None, :])

    @triton.jit
    def _paged_decode_combine_kernel(
        m_ptr, l_ptr, acc_ptr, out_ptr, stride_ob, stride_oh, splits,
        Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAD_S: tl.constexpr, PAD_D: tl.constexpr,
    ):
        """Program (sequence, query head): rescale every split to the common max and normalise.
        Empty splits (``denom == 0``) weigh nothing; an empty context yields zeros, as the reference."""
        b = tl.program_id(0)
        head = tl.program_id(1)
        split = tl.arange(0, PAD_S)
        dims = tl.arange(0, PAD_D)
        split_ok = split < splits
        part = (b * Q_HEADS + head) * splits + split
        m = tl.load(m_ptr + part, mask=split_ok, other=float("-inf"))
        denom = tl.load(l_ptr + part, mask=split_ok, other=0.0)
        acc = tl.load(
            acc_ptr + part[:, None] * HEAD_DIM + dims[None, :],
            mask=split_ok[:, None] & (dims < HEAD_DIM)[None, :], other=0.0,
        )
        m_max = tl.max(m, axis=0)
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # all splits empty: avoid -inf - -inf
        weight = tl.where(denom > 0, tl.exp2(m - m_max), 0.0)
        total = tl.sum(weight * denom, axis=0)
        out = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + b * stride_ob + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM
        )


# Splits per (sequence, kv head) are sized so the grid fills the GPU about this many times over,
# but no split gets fewer cached tokens than this (below it the combine costs more than it saves).
_WAVES = 2
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64


def _num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Split long contexts (flash-decoding) when batch x kv heads alone would leave SMs idle."""
    if device.type != "cuda":
        return 1
    programs = _WAVES * torch.cuda.get_device_properties(device).multi_processor_count
    wanted = triton.cdiv(programs, batch * kv_heads)
    return max(1, min(wanted, triton.cdiv(max_tokens, _MIN_SPLIT_TOKENS), _MAX_SPLITS))


def paged_decode_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Triton: same contract as the reference, in two launches: split attention, then combine.

    The query group is padded to 16 rows so ``tl.dot`` gets shapes a GPU accepts. K and V are
    upcast to fp32 right after loading: half-precision values are exact in tf32, so half caches
    still get tensor-core dots, and fp32 caches get exact (ieee) ones. The number of splits
    comes from the block table's width, not ``context_lens``, so nothing waits on the GPU."""
    require_triton()
    batch, q_heads, head_dim = query.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in head_dim")
    out = torch.empty_like(query)
    if batch == 0:
        return out
    # the kernel reads lengths at lens_ptr + b and a table's entries one after another
    block_tables, context_lens = block_tables.contiguous(), context_lens.contiguous()
    group = q_heads // kv_heads
    pad_d = max(16, next_pow2(head_dim))
    tile = max(16, next_pow2(block_size), _TILE_ELEMENTS // pad_d)
    max_tokens = max(1, block_tables.shape[1] * block_size)
    splits = _num_splits(batch, kv_heads, max_tokens, query.device)
    split_tokens = triton.cdiv(triton.cdiv(max_tokens, splits), tile) * tile
    splits = triton.cdiv(max_tokens, split_tokens)  # no split starts past every context
    m = torch.empty(batch, q_heads, splits, dtype=torch.float32, device=query.device)
    denom = torch.empty_like(m)
    acc = torch.empty(batch, q_heads, splits, head_dim, dtype=torch.float32, device=query.device)
    precision = "ieee" if torch.float32 in (k_cache.dtype, v_cache.dtype) else "tf32"
    _paged_decode_split_kernel[(batch, kv_heads, splits)](
        query, k_cache, v_cache, block_tables, context_lens, m, denom, acc,
        scale * _LOG2E, split_tokens, splits,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        Q_HEADS=q_heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        PAD_G=max(16, next_pow2(group)), PAD_D=pad_d, TILE_N=tile,
        PRECISION=precision,
    )
    _paged_decode_combine_kernel[(batch, q_heads)](
        m, denom, acc, out, out.stride(0), out.stride(1), splits,
        Q_HEADS=q_heads, HEAD_DIM=head_dim,
        PAD_S=next_pow2(splits), PAD_D=next_pow2(head_dim),
    )
    return out


def paged_decode_attention(query, k_cache, v_cache, block_tables, context_lens, scale):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(query, k_cache, v_cache, block_tables, context_lens):
        return paged_decode_attention_triton(query, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_torch(query, k_cache, v_cache, block_tables, context_lens, scale)
