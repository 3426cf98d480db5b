import pytest
import torch
import xxhash
from hypothesis import given, settings, strategies as st

from kvstore.blob import (
    FLAT_VERSION,
    HEADER_BYTES,
    LEAF_BYTES,
    TREE_VERSION,
    VERSION,
    VERSIONS,
    TreeDigest,
    payload_checksum,
    payload_digest,
    payload_matches,
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


def make_blob(dtype=torch.float16, key=KEY, version=VERSION) -> bytes:
    kv = torch.arange(32, dtype=torch.float32).reshape(TINY_NS.chunk_shape).to(dtype)
    payload = bytes(tensor_bytes(kv))
    return encode_header(key, 0, dtype, kv.shape, payload, version) + payload


def tree_checksum(payload: bytes) -> int:
    """Version 2's payload checksum as docs/blob-format.md defines it, written out here."""
    leaves = [xxhash.xxh3_64_intdigest(payload[i : i + 256 * 1024]) for i in range(0, len(payload), 256 * 1024)]
    return xxhash.xxh3_64_intdigest(b"".join(leaf.to_bytes(8, "little") for leaf in leaves))


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip(dtype, version):
    blob = make_blob(dtype, version=version)
    header, payload = verify_blob(blob, KEY)
    assert header.dtype == dtype and header.shape == TINY_NS.chunk_shape
    assert header.key_id == KEY.id and header.codec_id == 0 and header.version == version
    assert len(blob) == HEADER_BYTES + len(payload)


def test_version_2_is_written_by_default_and_its_checksum_is_the_documented_tree():
    assert VERSION == TREE_VERSION == 2 and LEAF_BYTES == 256 * 1024
    for size in (0, 1, LEAF_BYTES, LEAF_BYTES + 1, 3 * LEAF_BYTES - 5):
        payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
        assert payload_checksum(payload) == tree_checksum(payload)
    assert payload_checksum(b"abc", FLAT_VERSION) == xxhash.xxh3_64_intdigest(b"abc")
    with pytest.raises(ValueError):
        payload_digest(3)


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3 * 256 * 1024 + 100), cuts=st.lists(st.integers(0, 3 * 256 * 1024 + 100), max_size=6),
       whole_leaves=st.integers(0, 3))
def test_a_tree_digest_fed_in_any_pieces_or_whole_leaves_gives_the_checksum(size, cuts, whole_leaves):
    payload = (bytes(range(251)) * (size // 251 + 1))[:size]
    whole = min(whole_leaves, size // LEAF_BYTES) * LEAF_BYTES
    digest = TreeDigest()
    digest.extend([TreeDigest.leaf_checksum([payload[i : i + LEAF_BYTES]]) for i in range(0, whole, LEAF_BYTES)])
    edges = sorted({whole, size, *(c for c in cuts if whole <= c <= size)})
    for lo, hi in zip(edges, edges[1:]):
        digest.update(payload[lo:hi])
    assert digest.intdigest() == tree_checksum(payload)


def test_extend_refuses_to_start_inside_a_leaf():
    digest = TreeDigest()
    digest.update(b"x")
    with pytest.raises(ValueError, match="leaf boundary"):
        digest.extend([1])


def test_a_leaf_checksum_of_pieces_is_that_of_their_bytes():
    assert TreeDigest.leaf_checksum([b"ab", b"", b"cd"]) == xxhash.xxh3_64_intdigest(b"abcd")


@pytest.mark.parametrize("blob_version", VERSIONS)
@pytest.mark.parametrize("digest_version", VERSIONS)
def test_payload_matches_a_header_of_either_version_whatever_the_reader_guessed(blob_version, digest_version):
    """A reader picks its digest before it has the header; a guess of the other version
    costs a second pass over the payload, never a wrong verdict."""
    payload = bytes(range(256)) * 2000  # two leaves
    header = decode_header(encode_header(KEY, 0, torch.float16, TINY_NS.chunk_shape, payload, blob_version))
    for data, expected in ((payload, True), (payload[:-1] + b"\1", False)):
        digest = payload_digest(digest_version)
        digest.update(data)
        assert payload_matches(header, digest, data) is expected
        assert payload_matches(header, digest, [data[:1000], data[1000:]]) is expected


@pytest.mark.parametrize("version", VERSIONS)
def test_a_flipped_bit_in_any_leaf_of_a_long_payload_is_detected(version):
    payload = bytearray(bytes(range(256)) * 4000)  # four leaves
    head = encode_header(KEY, 0, torch.float16, TINY_NS.chunk_shape, bytes(payload), version)
    for pos in (0, LEAF_BYTES - 1, LEAF_BYTES, 2 * LEAF_BYTES + 17, len(payload) - 1):
        payload[pos] ^= 4
        with pytest.raises(PayloadChecksumMismatch):
            verify_blob(head + bytes(payload), KEY)
        payload[pos] ^= 4
    verify_blob(head + bytes(payload), KEY)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_flipped_byte_is_detected(data):
    blob = bytearray(make_blob(version=data.draw(st.sampled_from(VERSIONS))))
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

    blob = bytearray(make_blob())
    struct.pack_into("<H", blob, 4, 3)
    struct.pack_into("<Q", blob, 120, xxhash.xxh3_64_intdigest(bytes(blob[:120])))
    with pytest.raises(UnsupportedVersion):
        decode_header(bytes(blob))
    with pytest.raises(ValueError, match="version"):
        encode_header(KEY, 0, torch.float16, TINY_NS.chunk_shape, b"ab", 3)


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError):
        encode_header(KEY, 0, torch.int8, (2,), b"ab")
    with pytest.raises(ValueError):
        encode_header(KEY, 0, torch.float16, (), b"")
    with pytest.raises(ValueError):
        encode_header(KEY, 0, torch.float16, (1,) * 9, b"ab")


@pytest.mark.parametrize("version", VERSIONS)
def test_an_unsealed_blob_seals_to_the_header_encode_header_packs(version):
    """The fused put path (checksum computed while the payload is copied) writes the very
    header the two-pass path would, so the blob format is unchanged."""
    from kvstore.blob import UnsealedBlob

    ns = Namespace("m", 2, 1, 8, "float16", 16)
    (key,) = chunk_keys(list(range(16)), ns)
    payload = torch.randn(ns.chunk_shape).half().numpy().tobytes()
    blob = UnsealedBlob(key, 0, torch.float16, ns.chunk_shape, payload, version)
    blob.restart().update(payload[:100])  # a failed attempt saw some bytes; a retry starts afresh
    digest = blob.restart()
    for i in range(0, len(payload), 1000):
        digest.update(payload[i : i + 1000])
    assert blob.seal() == encode_header(key, 0, torch.float16, ns.chunk_shape, payload, version)
    assert blob.header == decode_header(blob.seal())
    verify_blob(blob.seal() + payload, key)
