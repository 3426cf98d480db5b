import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from kvstore.keys import ROOT_HASH, ChunkKey, Namespace, chain_hash, chunk_keys, prefix_hashes

SMOLLM2_NS = Namespace("smollm2-135m", num_layers=30, num_kv_heads=3, head_dim=64, chunk_tokens=4)

token_lists = st.lists(st.integers(0, 2**32 - 1), max_size=40)


@given(token_lists)
def test_one_key_per_full_chunk(tokens):
    keys = chunk_keys(tokens, SMOLLM2_NS)
    assert len(keys) == len(tokens) // SMOLLM2_NS.chunk_tokens
    assert all(k.namespace == SMOLLM2_NS for k in keys)


@given(token_lists, token_lists)
def test_keys_are_prefix_keys(a, b):
    """Equal keys at position i iff the first (i+1) chunks of tokens are equal."""
    ka, kb = chunk_keys(a, SMOLLM2_NS), chunk_keys(b, SMOLLM2_NS)
    for i, (x, y) in enumerate(zip(ka, kb)):
        same_prefix = a[: (i + 1) * 4] == b[: (i + 1) * 4]
        assert (x == y) == same_prefix


def test_hash_is_stable_across_processes():
    code = (
        "from kvstore.keys import prefix_hashes;"
        "print(','.join(h.hex() for h in prefix_hashes(list(range(10)), 4)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ",".join(h.hex() for h in prefix_hashes(list(range(10)), 4))
    # Pinned value: changing the hash silently would orphan every stored chunk.
    assert chain_hash(ROOT_HASH, [1, 2, 3, 4]).hex() == chain_hash(ROOT_HASH, (1, 2, 3, 4)).hex()
    assert prefix_hashes([1, 2, 3, 4], 4)[0].hex() == PINNED_FIRST_HASH


PINNED_FIRST_HASH = "4399d77240b8e1436416fd0f98c3d2c9"


def test_namespace_fingerprint_separates_what_is_incompatible():
    base = dict(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8)
    variants = [
        Namespace(**base),
        Namespace(**base, dtype="bfloat16"),
        Namespace(**base, chunk_tokens=128),
        Namespace(**base, tp_rank=1, tp_size=2),
        Namespace(**base, tenant="alice"),
        Namespace(**{**base, "model_id": "m2"}),
    ]
    assert len({v.fingerprint for v in variants}) == len(variants)
    assert Namespace(**base).fingerprint == Namespace(**base).fingerprint


def test_tenants_get_different_keys_for_identical_tokens():
    a = Namespace("m", 2, 1, 8, chunk_tokens=4, tenant="alice")
    b = Namespace("m", 2, 1, 8, chunk_tokens=4, tenant="bob")
    assert chunk_keys([1, 2, 3, 4], a)[0].id != chunk_keys([1, 2, 3, 4], b)[0].id


def test_no_two_namespaces_share_a_fingerprint_through_the_field_separator():
    """The fingerprint joins the fields with "\x1f": a model id holding one read as a model id
    and a longer tenant, so two namespaces had one fingerprint, and one's chunks were the
    other's hits. A model id with "\x1f" is refused."""
    fields = "\x1f".join(["2", "1", "8", "float16", "4", "LKTHD", "0", "1"])
    b = Namespace("m", 2, 1, 8, chunk_tokens=4, tenant="bob\x1f" + fields + "\x1falice")
    with pytest.raises(ValueError):
        Namespace("m\x1f" + fields + "\x1fbob", 2, 1, 8, chunk_tokens=4, tenant="alice")
    assert b.fingerprint != Namespace("m", 2, 1, 8, chunk_tokens=4, tenant="bob").fingerprint


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(model_id=""),
        dict(num_layers=0),
        dict(dtype="int8"),
        dict(tp_rank=2, tp_size=2),
        dict(layout="HND"),
    ],
)
def test_bad_namespace_is_rejected(kwargs):
    base = dict(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError):
        Namespace(**{**base, **kwargs})


def test_bad_inputs():
    with pytest.raises(ValueError):
        ChunkKey(SMOLLM2_NS, b"short")
    with pytest.raises(ValueError):
        chain_hash(b"x", [1])
    with pytest.raises(ValueError):
        chain_hash(ROOT_HASH, [-1])
    with pytest.raises(ValueError):
        prefix_hashes([1, 2], 0)
