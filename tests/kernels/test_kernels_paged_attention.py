"""Paged decode attention: the reference against dense attention, the Triton kernel (under
the interpreter, tiny shapes) against the reference."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_decode_attention_torch

pytest.importorskip("triton")
from kernels.paged_attention import paged_decode_attention_triton  # noqa: E402

# Output tolerances per dtype. bf16 is looser because the interpreter converts fp32 to bf16
# by truncation (one bf16 step, 2**-7 relative), where a GPU rounds to nearest.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}


def make_case(dtype, group, context_lens, block_size=4, kv_heads=2, head_dim=16, seed=0):
    """Random cache with shuffled block tables; table slots past each context hold junk ids."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    max_blocks = max(1, -(-max(context_lens) // block_size))
    num_blocks = batch * max_blocks + 3
    query = torch.randn(batch, kv_heads * group, head_dim, generator=gen).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * max_blocks].reshape(batch, max_blocks)
    return query, k_cache, v_cache, tables.to(torch.int32), torch.tensor(context_lens, dtype=torch.int32)


def test_reference_matches_dense_sdpa():
    query, k_cache, v_cache, tables, lens = make_case(torch.float32, group=3, context_lens=[5, 13, 8])
    scale = 0.25
    out = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, scale)
    block_size = k_cache.shape[1]
    for b, n in enumerate(lens.tolist()):
        blocks = tables[b, : -(-n // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [kv_heads, n, D]
        v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
        group = query.shape[1] // k.shape[0]
        dense = F.scaled_dot_product_attention(
            query[b].unsqueeze(1),  # [q_heads, 1, D]
            k.repeat_interleave(group, dim=0),
            v.repeat_interleave(group, dim=0),
            scale=scale,
        ).squeeze(1)
        torch.testing.assert_close(out[b], dense, atol=1e-5, rtol=1e-5)


# every dtype at SmolLM2's group of 3, every group size at fp16 (the full cross costs CPU time)
@pytest.mark.parametrize(
    "dtype, group",
    [(torch.float32, 3), (torch.bfloat16, 3), (torch.float16, 1), (torch.float16, 3), (torch.float16, 4)],
)
def test_triton_matches_reference(dtype, group):
    # 1 token, a partial block, an exact multiple of the block size, and two loop steps (128
    # tokens each at head_dim 16) ending in a partial block
    query, k_cache, v_cache, tables, lens = make_case(dtype, group, context_lens=[1, 7, 8, 150])
    got = paged_decode_attention_triton(query, k_cache, v_cache, tables, lens, 0.3)
    want = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, 0.3)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("block_size, head_dim", [(16, 32), (5, 24)])
def test_triton_block_sizes_and_head_dims(block_size, head_dim):
    """SmolLM2's block size, and a block size (loop steps straddle blocks) and head dim that
    are not powers of two."""
    query, k_cache, v_cache, tables, lens = make_case(
        torch.float32, 3, context_lens=[150, 3], block_size=block_size, head_dim=head_dim
    )
    got = paged_decode_attention_triton(query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    want = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, head_dim**-0.5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_triton_layer_slice_of_engine_cache():
    """The engine passes ``kv_cache[layer, 0]`` views of its all-layers cache."""
    query, k_cache, v_cache, tables, lens = make_case(torch.float16, 3, context_lens=[6, 11])
    all_layers = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # [layers, 2, blocks, bs, heads, D]
    got = paged_decode_attention_triton(query, all_layers[1, 0], all_layers[1, 1], tables, lens, 0.25)
    want = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, 0.25)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


def test_triton_empty_context_gives_zeros_like_reference():
    query, k_cache, v_cache, tables, lens = make_case(torch.float32, 1, context_lens=[0, 4])
    got = paged_decode_attention_triton(query, k_cache, v_cache, tables, lens, 0.5)
    want = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, 0.5)
    torch.testing.assert_close(got, want)
    assert not got[0].any()


@pytest.mark.parametrize("splits", [2, 3])
def test_triton_split_contexts_combine_to_the_reference(monkeypatch, splits):
    """Flash-decoding splits, including splits that start past a short context (empty)."""
    import kernels.paged_attention as paged_attention

    monkeypatch.setattr(paged_attention, "_num_splits", lambda *args: splits)
    # head_dim 32: 64-token loop steps, so 152 table tokens make up to 3 splits
    query, k_cache, v_cache, tables, lens = make_case(torch.float16, 3, context_lens=[150, 7, 0, 64], head_dim=32)
    got = paged_decode_attention_triton(query, k_cache, v_cache, tables, lens, 0.3)
    want = paged_decode_attention_torch(query, k_cache, v_cache, tables, lens, 0.3)
    torch.testing.assert_close(got, want, **TOL[torch.float16])


def test_split_count_fills_the_gpu_only_when_needed(monkeypatch):
    import kernels.paged_attention as paged_attention

    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))
    assert paged_attention._num_splits(1, 3, 8192, cuda) == 32  # capped: 256 tokens per split at least
    assert paged_attention._num_splits(1, 3, 100_000, cuda) == 64  # capped: at most 64 splits
    assert paged_attention._num_splits(128, 8, 8192, cuda) == 1  # the batch fills the GPU
    assert paged_attention._num_splits(1, 3, 8192, torch.device("cpu")) == 1
