"""Block gather/scatter between the all-layers paged cache and a chunk: the Triton kernel
(interpreter, tiny shapes) against the torch reference, and round trips; the one-layer
variants, and chunks viewed past their leading blocks (a load that skips locally held blocks)."""

import pytest
import torch

from kernels.block_copy import (
    gather_blocks_torch,
    gather_layer_blocks_torch,
    scatter_blocks_torch,
    scatter_layer_blocks_torch,
)

pytest.importorskip("triton")
from kernels.block_copy import (  # noqa: E402
    gather_blocks_triton,
    gather_layer_blocks_triton,
    scatter_blocks_triton,
    scatter_layer_blocks_triton,
)

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 3, 7, 4, 3, 8


def cache(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM, generator=gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_then_scatter_round_trip(dtype):
    kv = cache(dtype)
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    chunk = gather_blocks_triton(kv, ids)
    assert torch.equal(chunk, gather_blocks_torch(kv, ids))
    assert chunk.shape == (LAYERS, 2, 3 * BLOCK_SIZE, HEADS, DIM)

    target = torch.zeros_like(kv)
    other = torch.tensor([1, 6, 2], dtype=torch.int32)
    scatter_blocks_triton(chunk, target, other)
    expected = torch.zeros_like(kv)
    scatter_blocks_torch(chunk, expected, other)
    assert torch.equal(target, expected)
    assert torch.equal(gather_blocks_triton(target, other), chunk)
    untouched = [b for b in range(BLOCKS) if b not in other.tolist()]
    assert not target[:, :, untouched].any()


def test_gather_into_given_out_with_dtype_conversion():
    kv = cache(torch.float16)
    ids = torch.tensor([2, 4], dtype=torch.int64)
    out = torch.empty(LAYERS, 2, 2 * BLOCK_SIZE, HEADS, DIM, dtype=torch.float32)
    assert gather_blocks_triton(kv, ids, out) is out
    assert torch.equal(out, gather_blocks_torch(kv, ids).float())


def test_scatter_converts_chunk_to_cache_dtype():
    chunk = gather_blocks_torch(cache(torch.float32), torch.tensor([1]))
    target = torch.zeros(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM, dtype=torch.float16)
    expected = target.clone()
    scatter_blocks_triton(chunk, target, torch.tensor([4]))
    scatter_blocks_torch(chunk, expected, torch.tensor([4]))
    assert torch.equal(target, expected)


def test_large_block_spans_several_programs(monkeypatch):
    """A block bigger than one program's tile (as on a GPU with Llama shapes) is copied whole."""
    import kernels.block_copy as block_copy

    monkeypatch.setattr(block_copy, "_COPY_TILE", 32)  # block = 4 * 3 * 8 = 96 elements: 3 tiles
    kv = cache(torch.float32)
    ids = torch.tensor([6, 1])
    assert torch.equal(gather_blocks_triton(kv, ids), gather_blocks_torch(kv, ids))


def test_rejects_non_contiguous_blocks():
    kv = cache(torch.float32).transpose(4, 5)
    with pytest.raises(ValueError, match="contiguous"):
        gather_blocks_triton(kv, torch.tensor([0]))


def test_rejects_a_chunk_of_the_wrong_shape():
    with pytest.raises(ValueError, match="chunk shape"):
        one_block = torch.zeros(LAYERS, 2, BLOCK_SIZE, HEADS, DIM)
        scatter_blocks_triton(one_block, cache(torch.float32), torch.tensor([0, 1]))


def test_torch_gather_into_out_is_one_index_select():
    kv = cache(torch.float32)
    ids = torch.tensor([4, 1])
    out = torch.full((LAYERS, 2, 2 * BLOCK_SIZE, HEADS, DIM), -1.0)
    assert gather_blocks_torch(kv, ids, out) is out
    assert torch.equal(out, kv[:, :, [4, 1]].reshape(out.shape))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_variants_match_the_all_layers_copy(dtype):
    kv = cache(dtype)
    ids = torch.tensor([6, 2, 3])
    chunk = gather_blocks_torch(kv, ids)
    for layer in range(LAYERS):
        for gather in (gather_layer_blocks_torch, gather_layer_blocks_triton):
            assert torch.equal(gather(kv[layer], ids), chunk[layer])
    target, expected = torch.zeros_like(kv), torch.zeros_like(kv)
    dest = torch.tensor([0, 5, 1])
    for layer in range(LAYERS):
        scatter_layer_blocks_triton(chunk[layer], target[layer], dest)
        scatter_layer_blocks_torch(chunk[layer], expected[layer], dest)
    reference = torch.zeros_like(kv)
    scatter_blocks_torch(chunk, reference, dest)
    assert torch.equal(target, expected) and torch.equal(target, reference)


def test_scatter_of_a_chunk_past_its_leading_blocks_leaves_those_blocks_alone():
    """The first chunk of a load may overlap blocks the request shares with the local prefix
    cache: only the blocks past them are written."""
    chunk = gather_blocks_torch(cache(torch.float32, seed=1), torch.tensor([0, 1, 2, 3]))
    skip = 2
    tail = chunk[:, :, skip * BLOCK_SIZE:]
    for scatter in (scatter_blocks_torch, scatter_blocks_triton):
        kv = cache(torch.float32)
        shared = kv[:, :, [4, 5]].clone()
        scatter(tail, kv, torch.tensor([6, 0]))
        assert torch.equal(kv[:, :, [4, 5]], shared)
        assert torch.equal(kv[:, :, [6, 0]].reshape(tail.shape), tail)
    for scatter in (scatter_layer_blocks_torch, scatter_layer_blocks_triton):
        kv = cache(torch.float32)
        scatter(tail[1], kv[1], torch.tensor([6, 0]))
        assert torch.equal(kv[1, :, [6, 0]].reshape(tail[1].shape), tail[1])
