"""KV cache write: the Triton kernel (interpreter, tiny shapes) against the torch reference."""

import pytest
import torch

from kernels.cache_write import reshape_and_cache_torch

pytest.importorskip("triton")
from kernels.cache_write import reshape_and_cache_triton  # noqa: E402


def run_both(key_dtype, cache_dtype, slots, kv_heads=3, head_dim=16, num_blocks=4, block_size=4):
    gen = torch.Generator().manual_seed(1)
    tokens = len(slots)
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(key_dtype)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(key_dtype)
    # a sentinel background shows any write to a slot that should stay untouched
    k_cache = torch.full((num_blocks, block_size, kv_heads, head_dim), 7.0, dtype=cache_dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    reshape_and_cache_triton(key, value, k_cache, v_cache, slot_mapping)
    reshape_and_cache_torch(key, value, k_ref, v_ref, slot_mapping)
    return (k_cache, v_cache), (k_ref, v_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_reference_and_skips_padding(dtype):
    slots = [3, -1, 6, 15, -1, 0]
    (k, v), (k_ref, v_ref) = run_both(dtype, dtype, slots)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)  # same dtype: a pure copy, bit for bit
    written = torch.zeros(k.shape[0] * k.shape[1], dtype=torch.bool)
    written[[s for s in slots if s >= 0]] = True
    assert (k.flatten(0, 1)[~written] == 7.0).all()


def test_triton_converts_to_cache_dtype():
    (k, v), (k_ref, v_ref) = run_both(torch.float32, torch.float16, [1, 2, -1, 9])
    assert k.dtype == torch.float16 and torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_triton_into_bf16_cache_within_one_step():
    """fp32 -> bf16 rounds to nearest on a GPU but truncates under the interpreter."""
    (k, v), (k_ref, v_ref) = run_both(torch.float32, torch.bfloat16, [4, -1, 11])
    torch.testing.assert_close(k, k_ref, atol=0, rtol=2**-7)
    torch.testing.assert_close(v, v_ref, atol=0, rtol=2**-7)


def test_triton_non_power_of_two_heads_and_all_padding():
    (k, v), (k_ref, v_ref) = run_both(torch.float16, torch.float16, [5, 2], kv_heads=3, head_dim=24)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    (k, _), _ = run_both(torch.float16, torch.float16, [-1, -1])
    assert (k == 7.0).all()
