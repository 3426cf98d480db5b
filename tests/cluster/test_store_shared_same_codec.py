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
from kvstore.config import DiskTierConfig
from kvstore.store import Store
from pfs_peers import daemon, two_puts
from shared_tiers import chunks  # a head_dim the mixed codec can rank

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


def test_a_peers_blob_read_once_is_told_apart_from_the_one_that_replaces_it(tmp_path):
    """A copy found on the PFS (a lookup, its header never read) learns its blob's checksum
    on its first verified read, as it learns its codec: C's blob of the same codec and size
    that replaces B's later is a miss for A, not B's chunk."""
    keys, values = chunks(1, seed=13)
    key, value = keys[0], values[0]
    mine, _, theirs, _ = two_puts("raw", value)
    with Store(daemon(tmp_path, None, "raw")) as a:
        with Store(daemon(tmp_path, None, "raw")) as b:
            b.put(key, mine, durable=True)
        assert a.lookup(keys) == 1 and a.get_blob(key) is not None  # B's chunk, verified (and promoted)
        with Store(daemon(tmp_path, None, "raw")) as c:
            c.put(key, theirs, durable=True)
        assert a.drop(keys, "host") == 1
        assert a.get_blob(key) is None, "A read C's bytes as the chunk it had verified"


def test_a_copy_found_at_start_beside_a_private_one_is_told_apart_from_a_peers(tmp_path):
    """At start the PFS copy of a chunk the disk also holds is recorded with its header's
    checksum: a peer's blob of the same codec and size that replaces it is a miss."""
    keys, values = chunks(1, seed=14)
    key, value = keys[0], values[0]
    mine, _, theirs, _ = two_puts("raw", value)
    with_disk = daemon(tmp_path, None, "raw")
    with_disk.disk = DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=1 << 20, enabled=True)
    with Store(with_disk) as a:
        a.put(key, mine, durable=True)
    with Store(with_disk) as a:  # restarted: the disk's copy and the PFS's, headers read
        with Store(daemon(tmp_path, None, "raw")) as b:
            b.put(key, theirs, durable=True)
        assert a.drop(keys, "disk") == 1  # A's index lists its PFS copy alone
        assert a.get_blob(key) is None, "A read another put's bytes as those of its own last put"
