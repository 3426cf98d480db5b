"""Two daemons on one PFS mount put one chunk with the same codec and size but different
bytes (KV computed on another machine differs in low bits; a mixed-precision codec with its
own ranking, ``with_importance``, keeps other rows): B's blob replaces A's file. Before the
fix A's read compared the blob it found with what its index expected only while the copy's
codec was unknown: the codec matched, so A returned B's bytes as those of its own last put.
Each replica now records the payload checksum of the blob this store wrote or verified
there, and a shared tier's blob with another one is a peer's put: a miss, not its bytes."""

from __future__ import annotations

import pytest
import torch

from helpers import same
from kvstore.codecs import get_codec
from kvstore.store import Store
from test_store_shared import chunks  # a head_dim the mixed codec can rank
from test_store_shared_peers import daemon

MIXED = get_codec("mixed75")


def another_ranking(keys):
    """The default ranking reversed: other rows keep their bits, as many of them."""
    return -MIXED.importance(keys)


def two_puts(kind: str, value: torch.Tensor):
    """(A's value, A's codec, B's value, B's codec): one codec, blobs of one size, other bytes."""
    if kind == "raw":
        other = value.clone()
        other.view(-1)[0] += 1
        return value, "raw", other, "raw"
    return value, MIXED, value, MIXED.with_importance(another_ranking)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("kind", ["raw", "mixed"])
def test_a_peers_blob_of_the_same_codec_and_size_is_a_miss(tmp_path, kind, verify):
    keys, values = chunks(1, seed=11)
    key = keys[0]
    mine, my_codec, theirs, their_codec = two_puts(kind, values[0])
    with Store(daemon(tmp_path, None, "raw", verify)) as a:
        a.put(key, mine, durable=True, codec=my_codec)
        a_blob = a.get_blob(key)
        with Store(daemon(tmp_path, None, "raw", verify)) as b:
            b.put(key, theirs, durable=True, codec=their_codec)  # replaces A's file on the PFS
            b_blob = b.get_blob(key)
        assert b_blob != a_blob and len(b_blob) == len(a_blob), "not another blob of the same size"
        assert a.drop(keys, "host") == 1  # A's index lists its PFS copy alone, codec as put
        assert a.get_blob(key) is None, "A read another put's bytes as those of its own last put"
    assert list((tmp_path / "pfs").glob("**/*.kvb")), "A's read deleted B's acknowledged durable put"
    with Store(daemon(tmp_path, None, "raw", verify)) as b:
        assert b.get_blob(key) == b_blob


def test_a_copy_of_ours_read_again_is_still_a_hit(tmp_path):
    """The identity a put records is that of the blob it wrote: its own copy reads back."""
    keys, values = chunks(2, seed=12)
    with Store(daemon(tmp_path, None, "raw")) as a:
        for key, value in zip(keys, values):
            a.put(key, value, durable=True)
        assert a.drop(keys, "host") == 2
        out = torch.empty_like(values[0])
        for key, value in zip(keys, values):
            assert a.get_into(key, out) and same(out, value)
