"""Move whole engine blocks between the paged KV cache and a contiguous chunk buffer.

The engine keeps one cache tensor for all layers, ``[num_layers, 2, num_blocks,
block_size, kv_heads, head_dim]``; a store chunk is ``[num_layers, 2, n * block_size,
kv_heads, head_dim]`` for ``n`` blocks, so one call moves every layer at once.

The ``*_layer_blocks`` variants move one layer (``kv_cache[l]`` and ``chunk[l]``): a
layer-wise load scatters layer ``l`` while the model still computes layer ``l - 1``.
A chunk may be a view that skips its leading blocks (``chunk[:, :, k * block_size:]``),
so a load never rewrites blocks the request shares with the local prefix cache.
"""

from __future__ import annotations

import torch

from kernels._triton import next_pow2, require_triton, tl, triton, use_triton


def block_runs(block_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first block, position in the chunk, length)`` of each run of consecutive ids.

    Why: a run of consecutive blocks is one strided slice on both sides, which torch copies
    with all cores at close to memcpy speed; advanced indexing over the block dimension
    (``index_select``, ``index_put``) runs at a third of that. Engines allocate a request's
    blocks mostly in runs."""
    ids = block_ids.tolist()
    runs: list[tuple[int, int, int]] = []
    for i, b in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == b:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((b, i, 1))
    return runs


def gather_blocks_torch(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: copy blocks ``block_ids`` (in order) of every layer into a chunk tensor."""
    layers, two, _, block_size, heads, dim = kv_cache.shape
    n = block_ids.numel()
    if out is not None and not out.is_contiguous():
        return out.copy_(gather_blocks_torch(kv_cache, block_ids))
    if out is None:
        out = kv_cache.new_empty((layers, two, n * block_size, heads, dim))
    blocks = out.view(layers, two, n, block_size, heads, dim)
    for first, at, length in block_runs(block_ids):
        blocks[:, :, at:at + length].copy_(kv_cache[:, :, first:first + length])
    return out


def scatter_blocks_torch(chunk: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Reference: the inverse of ``gather_blocks``: write a chunk into blocks ``block_ids``."""
    layers, two, _, block_size, heads, dim = kv_cache.shape
    blocks = chunk.reshape(layers, two, block_ids.numel(), block_size, heads, dim)
    for first, at, length in block_runs(block_ids):
        kv_cache[:, :, first:first + length].copy_(blocks[:, :, at:at + length])


if triton is not None:

    @triton.jit
    def _block_copy_kernel(
        cache_ptr, chunk_ptr, ids_ptr,
        stride_cl, stride_ckv, stride_cb,
        stride_xl, stride_xkv, stride_xt,
        BLOCK_SIZE: tl.constexpr, BLOCK_ELEMS: tl.constexpr, TILE: tl.constexpr, TO_CHUNK: tl.constexpr,
    ):
        """Program (j, layer*2 + k/v, tile) copies one tile of block ``ids[j]`` of one layer half."""
        j = tl.program_id(0)
        layer = tl.program_id(1) // 2
        half = tl.program_id(1) % 2
        elems = tl.program_id(2) * TILE + tl.arange(0, TILE)
        mask = elems < BLOCK_ELEMS
        block = tl.load(ids_ptr + j).to(tl.int64)
        cache_at = cache_ptr + layer.to(tl.int64) * stride_cl + half * stride_ckv + block * stride_cb + elems
        chunk_at = (
            chunk_ptr + layer.to(tl.int64) * stride_xl + half * stride_xkv
            + j.to(tl.int64) * BLOCK_SIZE * stride_xt + elems
        )
        if TO_CHUNK:
            tl.store(chunk_at, tl.load(cache_at, mask=mask).to(chunk_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(cache_at, tl.load(chunk_at, mask=mask).to(cache_ptr.dtype.element_ty), mask=mask)


_COPY_TILE = 1024  # elements per program: several programs share a large block


def _block_copy_triton(kv_cache: torch.Tensor, chunk: torch.Tensor, block_ids: torch.Tensor, to_chunk: bool) -> None:
    """One launch for every layer, K and V, and block; each block is ``block_size * kv_heads *
    head_dim`` contiguous elements on both sides, so it is copied as a flat range."""
    require_triton()
    layers, _, _, block_size, heads, dim = kv_cache.shape
    block_elems = block_size * heads * dim
    n = block_ids.numel()
    if chunk.shape != (layers, 2, n * block_size, heads, dim):
        raise ValueError(f"chunk shape {tuple(chunk.shape)} is not {(layers, 2, n * block_size, heads, dim)}")
    if kv_cache.stride()[3:] != (heads * dim, dim, 1) or chunk.stride()[2:] != (heads * dim, dim, 1):
        raise ValueError("kv_cache and chunk must be contiguous in their last three dimensions")
    if n == 0:
        return
    block_ids = block_ids.contiguous()  # the kernel reads id j at ids_ptr + j, as the reference indexes
    tile = min(_COPY_TILE, next_pow2(block_elems))
    grid = (n, layers * 2, triton.cdiv(block_elems, tile))
    _block_copy_kernel[grid](
        kv_cache, chunk, block_ids,
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        chunk.stride(0), chunk.stride(1), chunk.stride(2),
        BLOCK_SIZE=block_size, BLOCK_ELEMS=block_elems, TILE=tile, TO_CHUNK=to_chunk,
    )


def gather_blocks_triton(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Triton: same contract as the reference."""
    layers, two, _, block_size, heads, dim = kv_cache.shape
    if out is None:
        out = kv_cache.new_empty((layers, two, block_ids.numel() * block_size, heads, dim))
    _block_copy_triton(kv_cache, out, block_ids, to_chunk=True)
    return out


def scatter_blocks_triton(chunk: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton: same contract as the reference."""
    _block_copy_triton(kv_cache, chunk, block_ids, to_chunk=False)


def gather_layer_blocks_torch(kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: ``gather_blocks`` for one layer: ``kv_layer`` ``[2, num_blocks, block_size,
    kv_heads, head_dim]`` -> ``[2, n * block_size, kv_heads, head_dim]``."""
    return gather_blocks_torch(kv_layer[None], block_ids, None if out is None else out[None])[0]


def scatter_layer_blocks_torch(chunk_layer: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Reference: ``scatter_blocks`` for one layer (the inverse of ``gather_layer_blocks``)."""
    scatter_blocks_torch(chunk_layer[None], kv_layer[None], block_ids)


def gather_layer_blocks_triton(kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton: same contract as the reference (the all-layers kernel over a one-layer view)."""
    _, _, block_size, heads, dim = kv_layer.shape
    if out is None:
        out = kv_layer.new_empty((2, block_ids.numel() * block_size, heads, dim))
    _block_copy_triton(kv_layer[None], out[None], block_ids, to_chunk=True)
    return out


def scatter_layer_blocks_triton(chunk_layer: torch.Tensor, kv_layer: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Triton: same contract as the reference."""
    _block_copy_triton(kv_layer[None], chunk_layer[None], block_ids, to_chunk=False)


def gather_blocks(kv_cache, block_ids, out=None):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    tensors = (kv_cache, block_ids) if out is None else (kv_cache, block_ids, out)
    if use_triton(*tensors):
        return gather_blocks_triton(kv_cache, block_ids, out)
    return gather_blocks_torch(kv_cache, block_ids, out)


def scatter_blocks(chunk, kv_cache, block_ids) -> None:
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(chunk, kv_cache, block_ids):
        scatter_blocks_triton(chunk, kv_cache, block_ids)
    else:
        scatter_blocks_torch(chunk, kv_cache, block_ids)


def gather_layer_blocks(kv_layer, block_ids, out=None):
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    tensors = (kv_layer, block_ids) if out is None else (kv_layer, block_ids, out)
    if use_triton(*tensors):
        return gather_layer_blocks_triton(kv_layer, block_ids, out)
    return gather_layer_blocks_torch(kv_layer, block_ids, out)


def scatter_layer_blocks(chunk_layer, kv_layer, block_ids) -> None:
    """Dispatch by device: the Triton kernel on CUDA, the torch reference elsewhere."""
    if use_triton(chunk_layer, kv_layer, block_ids):
        scatter_layer_blocks_triton(chunk_layer, kv_layer, block_ids)
    else:
        scatter_layer_blocks_torch(chunk_layer, kv_layer, block_ids)
