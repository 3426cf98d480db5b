"""Damaged payloads: every codec raises ValueError where the damage is detectable, and
never any other exception or a tensor of the wrong shape for arbitrary bytes."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.codecs import get_codec

CODECS = ["lz4", "int8", "int4", "mixed50", "mixed75"]
SHAPE = (2, 2, 8, 2, 64)


def payload_of(name: str, dtype=torch.float16) -> bytes:
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)).to(dtype)
    return bytes(get_codec(name).encode(x))


@pytest.mark.parametrize("name", CODECS)
def test_truncated_or_padded_payloads_raise(name):
    payload = payload_of(name)
    codec = get_codec(name)
    for damaged in (payload[:-1], payload[: len(payload) // 2], b"", payload + b"\0"):
        with pytest.raises(ValueError):
            codec.decode(damaged, SHAPE, torch.float16)


@pytest.mark.parametrize("name", CODECS)
def test_wrong_version_or_shape_raises(name):
    payload = payload_of(name)
    codec = get_codec(name)
    with pytest.raises(ValueError):
        codec.decode(bytes([payload[0] + 1]) + payload[1:], SHAPE, torch.float16)
    with pytest.raises(ValueError):
        codec.decode(payload, (2, 2, 9, 2, 64), torch.float16)


def test_lz4_rejects_bad_plane_headers():
    payload = bytearray(payload_of("lz4", torch.bfloat16))
    codec = get_codec("lz4")
    bad_mode = payload.copy()
    bad_mode[2] = 7
    bad_length = payload.copy()
    length = struct.unpack_from("<I", payload, 3)[0]
    struct.pack_into("<I", bad_length, 3, length - 1)
    for damaged in (bad_mode, bad_length):
        with pytest.raises(ValueError):
            codec.decode(bytes(damaged), SHAPE, torch.bfloat16)
    with pytest.raises(ValueError):
        codec.decode(bytes(payload), SHAPE, torch.float32)  # two planes, four expected


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_non_finite_or_negative_scales_raise(name):
    payload = bytearray(payload_of(name))
    codec = get_codec(name)
    rows = 2 * 2 * 8 * 2
    scale_at = 1 + (rows * 64 if name == "int8" else rows * 32)
    for bad in (float("nan"), -1.0, float("inf")):
        damaged = payload.copy()
        struct.pack_into("<f", damaged, scale_at, bad)
        with pytest.raises(ValueError):
            codec.decode(bytes(damaged), SHAPE, torch.float16)


def test_mixed_rejects_an_invalid_level():
    payload = bytearray(payload_of("mixed50"))
    payload[1] |= 3  # first row's level becomes 3, which does not exist
    with pytest.raises(ValueError):
        get_codec("mixed50").decode(bytes(payload), SHAPE, torch.float16)


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(CODECS), garbage=st.binary(max_size=300), keep=st.integers(0, 64))
def test_arbitrary_bytes_raise_value_error_or_decode_to_the_shape(name, garbage, keep):
    shape = (1, 2, 2, 1, 32)
    payload = bytes(get_codec(name).encode(torch.randn(shape)))[:keep] + garbage
    try:
        out = get_codec(name).decode(payload, shape, torch.float32)
    except ValueError:
        return
    assert out.shape == shape
