"""Two daemons on one PFS mount with the shared index (kvstore/cluster/shared_index.py), configured
with different codecs (the codec is not part of the key): a read that finds the peer's blob
where its own copy was forgets its copy, and leaves the peer's file and listing alone, also
where the PFS tier does not hash payloads on read (``verify_payload = false``): the blob's
header, whose own checksum is always verified, says whose put it is."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from helpers import NS, chunks  # noqa: E402
from kvstore.codecs import get_codec  # noqa: E402
from kvstore.store import Store  # noqa: E402
from pfs_peers import daemon  # noqa: E402


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("mine, theirs", [("raw", "int8"), ("int8", "raw")])
def test_a_read_that_finds_a_peers_blob_does_not_unlist_it(tmp_path, redis_server, mine, theirs, verify):
    """A puts a chunk; B puts the same key durably in another codec, replacing the PFS file
    and listing it in the shared index. Before the fix A's read of its PFS copy took B's
    blob (shorter, or too long for A's buffer) for a vanished file and removed the shared
    index's entry, which was B's: after B restarted (with a shared index the PFS is not
    scanned, chunks are found by lookups) B's acknowledged durable put was not found, and
    its file stayed on the mount, listed and evictable by nobody."""
    keys, values = chunks(1, seed=3)
    key, value = keys[0], values[0]
    with Store(daemon(tmp_path, redis_server.url, mine, verify)) as a:
        a.put(key, value, durable=True)
        with Store(daemon(tmp_path, redis_server.url, theirs, verify)) as b:
            b.put(key, value, durable=True)  # acknowledged: on the PFS, synced, in the shared index
        assert a.drop(keys, "host") == 1  # A's host RAM let it go; A's index lists its PFS copy
        out = torch.empty_like(value)
        assert not a.get_into(key, out)  # not A's put any more: a miss, not another put's bytes
        assert a.lookup(keys) == 1  # found again through the shared index: B's listing stays
    (path,) = (tmp_path / "pfs").glob("**/*.kvb")  # B's blob, whole
    with Store(daemon(tmp_path, redis_server.url, theirs, verify)) as b:
        assert b.lookup(keys) == 1, "B's durable put is on the PFS but no lookup can find it"
        assert b.get_into(key, out)


def _lz4_as_long_as_raw() -> torch.Tensor:
    """A chunk whose lz4 payload is exactly as long as its raw bytes, so both blobs have one
    size: random low bytes, high bytes random up to some point, then constant."""
    n = NS.chunk_bytes // 2
    for k in range(n):
        bits = torch.randint(0, 2**16, (n,), generator=torch.Generator().manual_seed(k), dtype=torch.int32)
        high = bits >> 8
        high[k:] = 0x3C
        x = ((high << 8) | (bits & 255)).to(torch.int16).view(torch.float16).reshape(NS.chunk_shape)
        if len(get_codec("lz4").encode(x)) == NS.chunk_bytes:
            return x
    raise AssertionError("no such chunk")


@pytest.mark.parametrize("verify", [True, False])
def test_a_peers_blob_of_the_same_size_in_another_codec_is_not_deleted(tmp_path, verify):
    """A puts a chunk raw, durably; B (lz4) puts it durably, and its blob, of the same size,
    replaces the PFS file. Where payloads were not hashed on read, A's read took the codec
    it did not expect for corruption and deleted B's synced file: B's acknowledged durable
    put was gone."""
    keys, _ = chunks(1, seed=5)
    key, value = keys[0], _lz4_as_long_as_raw()
    with Store(daemon(tmp_path, None, "raw", verify)) as a:
        a.put(key, value, durable=True)
        with Store(daemon(tmp_path, None, "lz4", verify)) as b:
            b.put(key, value, durable=True)
        assert a.drop(keys, "host") == 1  # A's index still lists its PFS copy
        assert not a.get_into(key, torch.empty_like(value))  # not A's put any more: a miss
    assert list((tmp_path / "pfs").glob("**/*.kvb")), "A's read deleted B's acknowledged durable put"
    with Store(daemon(tmp_path, None, "lz4", verify)) as b:
        out = torch.empty_like(value)
        assert b.lookup(keys) == 1 and b.get_into(key, out)
        assert torch.equal(out.view(torch.int16), value.view(torch.int16))
