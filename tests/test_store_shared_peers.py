"""Two daemons on one PFS mount with the shared index (kvstore/shared_index.py), configured
with different codecs (the codec is not part of the key): a read that finds the peer's blob
where its own copy was forgets its copy, and leaves the peer's file and listing alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from helpers import PAGE, chunks  # noqa: E402
from kvstore.config import (  # noqa: E402
    DiskTierConfig, HostTierConfig, PfsTierConfig, SharedIndexConfig, StoreConfig, WriteBehindConfig)
from kvstore.store import Store  # noqa: E402


def daemon(tmp_path, redis_url, codec: str) -> StoreConfig:
    """One daemon: its own host RAM, the shared PFS directory, the shared index."""
    return StoreConfig(
        host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(enabled=False),
        pfs=PfsTierConfig(enabled=True, path=str(tmp_path / "pfs"), capacity_bytes=1 << 22),
        write_behind=WriteBehindConfig(max_pending_bytes=16 * PAGE),
        shared_index=SharedIndexConfig(enabled=True, url=redis_url, key_prefix="review-pfs:i:", reconnect_s=0.2),
        codec=codec,
    )


@pytest.mark.parametrize("mine, theirs", [("raw", "int8"), ("int8", "raw")])
def test_a_read_that_finds_a_peers_blob_does_not_unlist_it(tmp_path, redis_server, mine, theirs):
    """A puts a chunk; B puts the same key durably in another codec, replacing the PFS file
    and listing it in the shared index. Before the fix A's read of its PFS copy took B's
    blob (shorter, or too long for A's buffer) for a vanished file and removed the shared
    index's entry, which was B's: after B restarted (with a shared index the PFS is not
    scanned, chunks are found by lookups) B's acknowledged durable put was not found, and
    its file stayed on the mount, listed and evictable by nobody."""
    keys, values = chunks(1, seed=3)
    key, value = keys[0], values[0]
    with Store(daemon(tmp_path, redis_server.url, mine)) as a:
        a.put(key, value, durable=True)
        with Store(daemon(tmp_path, redis_server.url, theirs)) as b:
            b.put(key, value, durable=True)  # acknowledged: on the PFS, synced, in the shared index
        assert a.drop(keys, "host") == 1  # A's host RAM let it go; A's index lists its PFS copy
        out = torch.empty_like(value)
        assert not a.get_into(key, out)  # not A's put any more: a miss, not another put's bytes
        assert a.lookup(keys) == 1  # found again through the shared index: B's listing stays
    (path,) = (tmp_path / "pfs").glob("**/*.kvb")  # B's blob, whole
    with Store(daemon(tmp_path, redis_server.url, theirs)) as b:
        assert b.lookup(keys) == 1, "B's durable put is on the PFS but no lookup can find it"
        assert b.get_into(key, out)
