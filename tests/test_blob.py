import pytest
import torch
from hypothesis import given, settings, strategies as st

from kvstore.blob import (
    HEADER_BYTES,
    BadMagic,
    CorruptBlob,
    HeaderChecksumMismatch,
    KeyMismatch,
    PayloadChecksumMismatch,
    TruncatedBlob,
    UnsupportedVersion,
    decode_header,
    encode_header,
    verify_blob,
)
from kvstore.codecs.raw import tensor_bytes
from kvstore.keys import Namespace, chunk_keys

TINY_NS = Namespace("m", num_layers=2, num_kv_heads=1, head_dim=4, chunk_tokens=2)
KEY, OTHER = chunk_keys([1, 2, 3, 4], TINY_NS)


def make_blob(dtype=torch.float16, key=KEY) -> bytes:
    kv = torch.arange(32, dtype=torch.float32).reshape(TINY_NS.chunk_shape).to(dtype)
    payload = bytes(tensor_bytes(kv))
    return encode_header(key, 0, dtype, kv.shape, payload) + payload


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip(dtype):
    blob = make_blob(dtype)
    header, payload = verify_blob(blob, KEY)
    assert header.dtype == dtype and header.shape == TINY_NS.chunk_shape
    assert header.key_id == KEY.id and header.codec_id == 0
    assert len(blob) == HEADER_BYTES + len(payload)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_detected(data):
    blob = bytearray(make_blob())
    pos = data.draw(st.integers(0, len(blob) - 1))
    bit = data.draw(st.integers(0, 7))
    blob[pos] ^= 1 << bit
    with pytest.raises(CorruptBlob):
        verify_blob(bytes(blob), KEY)


@given(st.integers(0, 127 + 64 - 1))
def test_any_truncation_is_detected(cut):
    blob = make_blob()
    with pytest.raises(CorruptBlob):
        verify_blob(blob[:cut], KEY)


def test_specific_errors():
    blob = make_blob()
    with pytest.raises(BadMagic):
        decode_header(b"XXXX" + blob[4:])
    with pytest.raises(TruncatedBlob):
        decode_header(blob[:100])
    with pytest.raises(TruncatedBlob):
        verify_blob(blob + b"\0", KEY)
    with pytest.raises(KeyMismatch):
        verify_blob(blob, OTHER)
    bad_payload = bytearray(blob)
    bad_payload[-1] ^= 1
    with pytest.raises(PayloadChecksumMismatch):
        verify_blob(bytes(bad_payload), KEY)
    bad_header = bytearray(blob)
    bad_header[20] ^= 1
    with pytest.raises(HeaderChecksumMismatch):
        decode_header(bytes(bad_header))


def test_unknown_version_is_rejected():
    import struct

    import xxhash

    blob = bytearray(make_blob())
    struct.pack_into("<H", blob, 4, 99)
    struct.pack_into("<Q", blob, 120, xxhash.xxh3_64_intdigest(bytes(blob[:120])))
    with pytest.raises(UnsupportedVersion):
        decode_header(bytes(blob))


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError):
        encode_header(KEY, 0, torch.int8, (2,), b"ab")
    with pytest.raises(ValueError):
        encode_header(KEY, 0, torch.float16, (), b"")
    with pytest.raises(ValueError):
        encode_header(KEY, 0, torch.float16, (1,) * 9, b"ab")


def test_an_unsealed_blob_seals_to_the_header_encode_header_packs():
    """The fused put path (checksum computed while the payload is copied) writes the very
    header the two-pass path would, so the blob format is unchanged."""
    from kvstore.blob import UnsealedBlob

    ns = Namespace("m", 2, 1, 8, "float16", 16)
    (key,) = chunk_keys(list(range(16)), ns)
    payload = torch.randn(ns.chunk_shape).half().numpy().tobytes()
    blob = UnsealedBlob(key, 0, torch.float16, ns.chunk_shape, payload)
    blob.restart().update(payload[:100])  # a failed attempt saw some bytes; a retry starts afresh
    digest = blob.restart()
    for i in range(0, len(payload), 1000):
        digest.update(payload[i : i + 1000])
    assert blob.seal() == encode_header(key, 0, torch.float16, ns.chunk_shape, payload)
    assert blob.header == decode_header(blob.seal())
    verify_blob(blob.seal() + payload, key)
