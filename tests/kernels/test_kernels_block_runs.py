"""The torch references of kernels/block_copy copy runs of consecutive blocks as slices:
checked against a block-by-block copy on random block lists (repeats and gaps included for
gathers, distinct ids for scatters), with chunks viewed past their leading blocks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.block_copy import block_runs, gather_blocks_torch, scatter_blocks_torch, scatter_layer_blocks_torch

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 2, 9, 3, 2, 4


def cache(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM, generator=gen).half()


def test_runs_of_consecutive_ids():
    assert block_runs(torch.tensor([4, 5, 6, 0, 2, 3, 3])) == [(4, 0, 3), (0, 3, 1), (2, 4, 2), (3, 6, 1)]
    assert block_runs(torch.tensor([], dtype=torch.int64)) == []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, BLOCKS - 1), max_size=12))
def test_gather_equals_a_block_by_block_copy(ids):
    kv = cache()
    expected = torch.cat([kv[:, :, b] for b in ids], dim=2) if ids else kv.new_empty(LAYERS, 2, 0, HEADS, DIM)
    assert torch.equal(gather_blocks_torch(kv, torch.tensor(ids, dtype=torch.int64)), expected)
    out = torch.empty(LAYERS, 2, len(ids) * BLOCK_SIZE, HEADS, DIM, dtype=torch.float32)
    assert torch.equal(gather_blocks_torch(kv, torch.tensor(ids, dtype=torch.int32), out), expected.float())


@settings(max_examples=200, deadline=None)
@given(st.permutations(range(BLOCKS)).flatmap(lambda p: st.integers(0, BLOCKS).map(lambda n: p[:n])),
       st.integers(0, 2))
def test_scatter_writes_exactly_the_named_blocks(ids, skip):
    source = cache(1)
    staged = torch.cat([source[:, :, 0]] * skip + [source[:, :, b] for b in range(len(ids))], dim=2) \
        if ids or skip else source.new_empty(LAYERS, 2, 0, HEADS, DIM)
    chunk = staged[:, :, skip * BLOCK_SIZE:]  # a load that skips locally held blocks
    target = cache(2)
    expected = target.clone()
    for i, b in enumerate(ids):
        expected[:, :, b] = chunk[:, :, i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
    scatter_blocks_torch(chunk, target, torch.tensor(ids, dtype=torch.int64))
    assert torch.equal(target, expected)
    layer = cache(2)[1].clone()
    scatter_layer_blocks_torch(chunk[1], layer, torch.tensor(ids, dtype=torch.int64))
    assert torch.equal(layer, expected[1])
