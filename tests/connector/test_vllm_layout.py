"""vLLM's paged KV layouts against our chunk layout, on CPU tensors (no vLLM needed): the CPU
backend's layout is the one measured with real vLLM (tests/connector/test_vllm_e2e.py); the GPU ones
are written from vLLM's backends and checked here on CPU tensors of their shapes."""

import pytest
import torch

from connector.metadata import ChunkLoad
from connector.vllm_layout import PagedLayers, UnknownLayoutError, blocks_view, layout_of

BLOCKS, HEADS, BS, DIM, LAYERS = 7, 3, 4, 5, 2


def reference_kv(seed: int) -> torch.Tensor:
    """K and V of every (block, position, head, dim): ``[2, blocks, block_size, heads, dim]``."""
    return torch.randn(2, BLOCKS, BS, HEADS, DIM, generator=torch.Generator().manual_seed(seed))


def in_layout(ref: torch.Tensor, layout: str) -> torch.Tensor:
    """``ref`` written the way each backend stores it, built from its definition, not from our views."""
    if layout == "cpu":  # per (block, head): block_size rows of K, then block_size rows of V
        kv = torch.empty(BLOCKS, HEADS, BS, 2 * DIM)
        rows = kv.view(BLOCKS, HEADS, 2 * BS, DIM)
        for b in range(BLOCKS):
            for h in range(HEADS):
                rows[b, h, :BS] = ref[0, b, :, h]
                rows[b, h, BS:] = ref[1, b, :, h]
        return kv
    if layout == "flash":
        return ref.clone()
    return ref.transpose(0, 1).contiguous()  # flashinfer: [blocks, 2, block_size, heads, dim]


@pytest.mark.parametrize("layout", ["cpu", "flash", "flashinfer"])
def test_each_layout_is_recognised_and_viewed_as_blocks(layout):
    ref = reference_kv(0)
    kv = in_layout(ref, layout)
    assert layout_of(kv, BS, HEADS, DIM) == layout
    view = blocks_view(kv, layout)
    assert torch.equal(view, ref)
    assert view.data_ptr() == kv.data_ptr()  # a view: loads write vLLM's memory


def test_a_tensor_in_no_known_layout_is_refused():
    with pytest.raises(UnknownLayoutError):
        layout_of(torch.empty(BLOCKS, HEADS, BS, DIM), BS, HEADS, DIM)


@pytest.mark.parametrize("layout", ["cpu", "flash", "flashinfer"])
def test_gather_gives_the_chunk_layout_and_scatter_writes_only_its_blocks(layout):
    refs = [reference_kv(10 + i) for i in range(LAYERS)]
    mover = PagedLayers([blocks_view(in_layout(r, layout), layout) for r in refs])
    ids = [5, 2, 3]  # a run (2, 3) and a lone block
    chunk = torch.empty(LAYERS, 2, len(ids) * BS, HEADS, DIM)
    mover.gather(ids, chunk)
    for layer, ref in enumerate(refs):
        expected = torch.cat([ref[:, b] for b in ids], dim=1)  # [2, tokens, heads, dim]
        assert torch.equal(chunk[layer], expected)

    kvs = [in_layout(torch.zeros(2, BLOCKS, BS, HEADS, DIM), layout) for _ in range(LAYERS)]
    target = PagedLayers([blocks_view(kv, layout) for kv in kvs])
    # the first block is shared with vLLM's prefix cache: skipped, left untouched
    target.scatter(chunk, ChunkLoad(key=None, block_ids=(1, 6), skip_blocks=1))
    for layer, kv in enumerate(kvs):
        got = blocks_view(kv, layout)
        assert torch.equal(got[:, 1], refs[layer][:, 2]) and torch.equal(got[:, 6], refs[layer][:, 3])
        others = [b for b in range(BLOCKS) if b not in (1, 6)]
        assert not got[:, others].any()
