"""int8/int4 quantisation: the documented error bound, ties to even, and the Triton kernels
(interpreter, tiny shapes) bit-identical to the torch references."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.quant import dequantize_int4_torch, dequantize_int8_torch, quantize_int4_torch, quantize_int8_torch

pytest.importorskip("triton")
from kernels.quant import (  # noqa: E402
    dequantize_int4_triton,
    dequantize_int8_triton,
    quantize_int4_triton,
    quantize_int8_triton,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def sample(dtype, shape=(2, 3, 64), seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * torch.logspace(-3, 3, shape[-1])  # mixed magnitudes
    x[0, 0] = 0  # an all-zero row / group: scale 0
    return x.to(dtype)


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g, w)


def assert_dequantised_close(got, want, dtype):
    if dtype == torch.bfloat16:  # the interpreter truncates fp32 -> bf16 (a GPU rounds): one step
        torch.testing.assert_close(got, want, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_triton_matches_reference(dtype):
    x = sample(dtype)
    q, scale = quantize_int8_triton(x)
    assert_same((q, scale), quantize_int8_torch(x))
    assert_dequantised_close(dequantize_int8_triton(q, scale, dtype), dequantize_int8_torch(q, scale, dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [16, 32, 64])
def test_int4_triton_matches_reference(dtype, group_size):
    x = sample(dtype)
    packed, scale, zero = quantize_int4_triton(x, group_size)
    assert_same((packed, scale, zero), quantize_int4_torch(x, group_size))
    got = dequantize_int4_triton(packed, scale, zero, group_size, dtype)
    assert_dequantised_close(got, dequantize_int4_torch(packed, scale, zero, group_size, dtype), dtype)


@settings(max_examples=15, deadline=None)
@given(
    rows=st.integers(1, 20),
    values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=32, max_size=32),
)
def test_quantised_bytes_identical_on_random_rows(rows, values):
    base = torch.tensor(values, dtype=torch.float32)
    x = torch.stack([base * (r + 1) / 7 for r in range(rows)])
    assert_same(quantize_int8_triton(x), quantize_int8_torch(x))
    assert_same(quantize_int4_triton(x, 8), quantize_int4_torch(x, 8))


def test_ties_round_to_even_like_torch_round():
    # int8: amax 127 -> scale 1, so x / scale lands exactly on .5 ties
    row = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5]])
    expected = torch.tensor([[127, 0, 2, 2, 0, -2, -2, 126]], dtype=torch.int8)
    for quantize in (quantize_int8_torch, quantize_int8_triton):
        q, scale = quantize(row)
        assert torch.equal(q, expected) and scale.item() == 1.0
    # int4: lo 0, hi 15 -> scale 1, zero 0; low nibble first
    group = torch.tensor([[0.0, 15.0, 0.5, 1.5, 2.5, 3.5, 14.5, 13.5]])
    nibbles = [0, 15, 0, 2, 2, 4, 14, 14]
    packed = torch.tensor([[lo | hi << 4 for lo, hi in zip(nibbles[0::2], nibbles[1::2])]], dtype=torch.uint8)
    for quantize in (quantize_int4_torch, quantize_int4_triton):
        got, scale, zero = quantize(group, 8)
        assert torch.equal(got, packed) and scale.item() == 1.0 and zero.item() == 0.0


@pytest.mark.parametrize("quantize, dequantize", [(quantize_int8_torch, dequantize_int8_torch),
                                                  (quantize_int8_triton, dequantize_int8_triton)])
def test_int8_error_within_half_a_step(quantize, dequantize):
    x = sample(torch.float32)
    q, scale = quantize(x)
    err = (dequantize(q, scale, torch.float32) - x).abs()
    assert (err <= scale.unsqueeze(-1) * (0.5 + 1e-6) + 1e-30).all()
    assert not dequantize(q, scale, torch.float32)[0, 0].any()


@pytest.mark.parametrize("quantize, dequantize", [(quantize_int4_torch, dequantize_int4_torch),
                                                  (quantize_int4_triton, dequantize_int4_triton)])
def test_int4_error_within_half_a_step(quantize, dequantize):
    x = sample(torch.float32)
    packed, scale, zero = quantize(x, 16)
    err = (dequantize(packed, scale, zero, 16, torch.float32) - x).reshape(2, 3, 4, 16).abs()
    # half a step, plus fp32 rounding of q * scale + zero relative to the group's magnitude
    bound = scale.unsqueeze(-1) * 0.5 + x.reshape(2, 3, 4, 16).abs().amax(-1, keepdim=True) * 1e-6
    assert (err <= bound).all()


def test_int4_rejects_bad_group_size():
    x = torch.zeros(2, 24)
    for quantize in (quantize_int4_torch, quantize_int4_triton):
        with pytest.raises(ValueError):
            quantize(x, 16)  # 24 is not a multiple of 16
        with pytest.raises(ValueError):
            quantize(x, 3)  # odd


def test_int4_round_trip_of_zero_rows():
    """Regression: dequantising an empty batch of rows used to fail on an ambiguous reshape."""
    from kernels.quant import dequantize_int4_torch, quantize_int4_torch

    packed, scale, zero = quantize_int4_torch(torch.empty(0, 64), 32)
    assert dequantize_int4_torch(packed, scale, zero, 32, torch.float16).shape == (0, 64)
