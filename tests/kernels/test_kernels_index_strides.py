"""The Triton kernels take their index tensors (block ids, slot mappings, block tables,
context lengths) as the references do, whatever their strides: a view that is not
contiguous (a column of a table, a strided slice, a column-major table) names the same
blocks and slots. Before the fix the kernels read ``ptr + i`` and so took other blocks and
slots than the reference: wrong KV gathered or scattered, cache slots written that no
token owns, attention over another sequence's blocks. Interpreter, tiny shapes."""

import pytest
import torch

from kernels.block_copy import gather_blocks_torch, scatter_blocks_torch
from kernels.cache_write import reshape_and_cache_torch
from kernels.paged_attention import paged_decode_attention_torch

pytest.importorskip("triton")
from kernels.block_copy import gather_blocks_triton, scatter_blocks_triton  # noqa: E402
from kernels.cache_write import reshape_and_cache_triton  # noqa: E402
from kernels.paged_attention import paged_decode_attention_triton  # noqa: E402

BLOCKS, BLOCK_SIZE, HEADS, DIM = 16, 4, 2, 16


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_block_copy_with_strided_block_ids():
    kv = torch.randn(2, 2, BLOCKS, BLOCK_SIZE, HEADS, DIM, generator=gen())
    ids = torch.tensor([3, 9, 1, 5, 7, 2])[::2]  # blocks 3, 1, 7
    assert torch.equal(gather_blocks_triton(kv, ids), gather_blocks_torch(kv, ids))
    chunk = torch.randn(2, 2, 3 * BLOCK_SIZE, HEADS, DIM, generator=gen(1))
    got, want = torch.zeros_like(kv), torch.zeros_like(kv)
    scatter_blocks_triton(chunk, got, ids)
    scatter_blocks_torch(chunk, want, ids)
    assert torch.equal(got, want)


def test_cache_write_with_a_strided_slot_mapping():
    key = torch.randn(3, HEADS, DIM, generator=gen())
    value = torch.randn(3, HEADS, DIM, generator=gen(1))
    slots = torch.tensor([[0, -1], [5, -1], [9, -1]])[:, 0]  # slots 0, 5, 9
    caches = [torch.zeros(BLOCKS, BLOCK_SIZE, HEADS, DIM) for _ in range(4)]
    reshape_and_cache_torch(key, value, caches[0], caches[1], slots)
    reshape_and_cache_triton(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])


@pytest.mark.parametrize("layout", ["strided", "column-major"])
def test_decode_attention_with_non_contiguous_tables_and_lengths(layout):
    k = torch.randn(BLOCKS, BLOCK_SIZE, HEADS, DIM, generator=gen())
    v = torch.randn(BLOCKS, BLOCK_SIZE, HEADS, DIM, generator=gen(1))
    wide = torch.randperm(BLOCKS, generator=gen(2)).to(torch.int32).reshape(2, 8)
    tables = wide[:, ::2] if layout == "strided" else wide[:, :5].t().contiguous().t()
    lens = torch.tensor([[13, 0], [9, 0]], dtype=torch.int32)[:, 0]
    query = torch.randn(2, 2 * HEADS, DIM, generator=gen(3))
    want = paged_decode_attention_torch(query, k, v, tables, lens, 0.25)
    got = paged_decode_attention_triton(query, k, v, tables, lens, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
