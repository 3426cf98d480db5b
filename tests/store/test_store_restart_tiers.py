"""A restart over several persistent tiers, one of them shared (a PFS directory): which of
their copies are the chunk's current version, and which may hold a durable put. Real files,
real Stores; failures injected with tests/faults.py."""

from __future__ import annotations

import pytest
import torch

from faults import FaultyTier
from helpers import chunks, same, store_config
from kvstore.blob import decode_header
from kvstore.codecs import get_codec
from kvstore.config import SharedIndexConfig
from kvstore.store import Store
from tiers.pfs import PfsTier


def pfs_tier(tmp_path, capacity=1 << 20) -> FaultyTier:
    return FaultyTier(PfsTier(tmp_path / "pfs", capacity))


def test_a_pfs_copy_replacing_a_durable_file_found_at_start_is_synced(tmp_path):
    """The PFS twin of test_a_copy_replacing_a_file_found_at_start_is_synced. Recovery syncs
    only private tiers' files (a shared tier's belong to every daemon), so before the fix a
    PFS file found at start counted as unsynced, and a plain re-put's copy replaced a durable
    put's file with one no sync covered: a power loss could then empty it."""
    keys, values = chunks(1)
    cfg = store_config(tmp_path, disk=None)
    with Store(cfg, extra_tiers=[pfs_tier(tmp_path)]) as store:
        store.put(keys[0], values[0], durable=True)  # on the PFS, file and directory fsync'ed
    pfs = pfs_tier(tmp_path)
    with Store(cfg, extra_tiers=[pfs]) as store:
        store.put(keys[0], values[0], codec="lz4")  # a new version, copied behind, not durable
        assert store.flush(timeout_s=30)
        assert pfs.calls.get("write") == 1
        # the durable put's file was replaced by one no sync covered: a power loss may empty it
        assert keys[0].id not in pfs.unsynced


@pytest.mark.parametrize("shared_index", [False, True])
def test_an_older_put_left_on_the_pfs_is_not_taken_for_a_later_put_after_restart(tmp_path, request, shared_index):
    """The PFS copy of a raw re-put failed, so the PFS still holds the older int8 put while
    the disk holds the raw one. Before the fix recovery made every file a current replica,
    whatever put it held: after a restart the entry's header was the disk's (raw), a put of
    that raw blob was taken to be on the PFS already, nothing was copied, and a read served
    by the PFS returned the int8 put's (lossy) bytes after the raw put was acknowledged. With
    a shared index the PFS is not scanned at start: its copy is found by a lookup, its header
    unseen, and before the fix it counted as the raw put's just the same."""
    keys, values = chunks(1)
    key, value = keys[0], values[0]
    cfg = store_config(tmp_path)  # host RAM, local disk
    if shared_index:
        pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")
        cfg.shared_index = SharedIndexConfig(enabled=True, url=request.getfixturevalue("redis_server").url,
                                             key_prefix="restart-tiers:i:")
    pfs = pfs_tier(tmp_path)
    with Store(cfg, extra_tiers=[pfs]) as store:
        store.put(key, value, codec="int8", durable=True)  # disk and PFS hold int8
        pfs.failures["write"] = 1  # the PFS copy of the next put fails (an I/O error)
        store.put(key, value)  # raw: the disk's copy lands, the PFS keeps the int8 file
        assert store.flush(timeout_s=30)
    assert decode_header(pfs.inner.peek(key.id, 128)).codec_id == get_codec("int8").codec_id
    with Store(cfg, extra_tiers=[pfs_tier(tmp_path)]) as store:
        store.put(key, value)  # acknowledged: the raw put is the last one
        assert store.flush(timeout_s=30)
        assert store.drop(keys, "host") == 1 and store.drop(keys, "disk") == 1  # host evicted, disk too
        assert store.lookup(keys) == 1  # the index says the PFS holds the current version
        out = torch.empty_like(value)
        assert store.get_into(key, out)
        int8 = get_codec("int8")
        older = int8.decode(int8.encode(value), value.shape, value.dtype)
        assert not same(out, older), "the read returned the older int8 put's bytes"
        assert same(out, value)
