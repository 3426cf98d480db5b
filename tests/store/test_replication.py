"""The replication planner (kvstore/store/replication.py) and the Store's use of it."""

import pytest
import torch

from helpers import WIDE_NS
from kvstore.config import (DiskTierConfig, HostTierConfig, PfsTierConfig, PlacementConfig, ReplicationConfig,
                            StoreConfig, WriteBehindConfig)
from kvstore.keys import chunk_keys
from kvstore.store.replication import DisplacedReuse, TierOption, plan
from kvstore.store import Store

MB = 10**6
SIZE = 64 * MB  # a 64 MB chunk: 64 ms from the disk at 1 GB/s, 32 ms from the PFS at 2 GB/s
RECOMPUTE_S = 0.1


def options(room: bool, displaced: float = 1.0) -> list[TierOption]:
    return [TierOption("disk", 1e9, SIZE, room, displaced), TierOption("pfs", 2e9, SIZE, room, displaced)]


def test_with_room_everywhere_every_tier_gets_a_copy_fastest_first():
    assert plan(1.0, SIZE, RECOMPUTE_S, {}, options(room=True)) == ["pfs", "disk"]


def test_under_pressure_a_typical_chunk_gets_one_copy_where_it_saves_most():
    assert plan(1.0, SIZE, RECOMPUTE_S, {}, options(room=False)) == ["pfs"]


def test_under_pressure_a_hot_chunk_gets_more_copies_and_a_cold_one_one():
    # a second copy saves 32 - 21.3 ms per use; it displaces a typical chunk's 36 ms on the disk
    assert plan(4.0, SIZE, RECOMPUTE_S, {}, options(room=False)) == ["pfs", "disk"]
    assert plan(3.0, SIZE, RECOMPUTE_S, {}, options(room=False)) == ["pfs"]
    assert plan(0.1, SIZE, RECOMPUTE_S, {}, options(room=False, displaced=5.0)) == ["pfs"]
    assert plan(0.0, SIZE, RECOMPUTE_S, {}, options(room=True)) == []


def test_a_chunk_that_has_copies_is_planned_from_them():
    assert plan(1.0, SIZE, RECOMPUTE_S, {"pfs": 2e9}, options(room=False)) == []
    assert plan(1.0, SIZE, RECOMPUTE_S, {"pfs": 2e9}, options(room=True)) == ["disk"]


def test_a_tier_slower_than_recomputing_gets_nothing():
    slow = [TierOption("disk", SIZE / (2 * RECOMPUTE_S), SIZE, True, 1.0)]
    assert plan(1.0, SIZE, RECOMPUTE_S, {}, slow) == []


def test_displaced_reuse_follows_the_victims():
    d = DisplacedReuse()
    assert d["disk"] == 1.0
    for _ in range(200):
        d.evicted("disk", 0.2)
    assert d["disk"] == pytest.approx(0.2, abs=1e-3) and d["pfs"] == 1.0


BLOB_PAGES = 5  # 128-byte header + 16 KiB in 4 KiB pages (and disk blocks)


def store_config(tmp_path, mode: str) -> StoreConfig:
    room = 4 * BLOB_PAGES * 4096
    return StoreConfig(
        host=HostTierConfig(capacity_bytes=2 * BLOB_PAGES * 4096, page_bytes=4096, prefault=False),
        disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=room),
        pfs=PfsTierConfig(enabled=True, path=str(tmp_path / "pfs"), capacity_bytes=room),
        write_behind=WriteBehindConfig(max_pending_bytes=BLOB_PAGES * 4096),
        eviction_policy="lru",
        placement=PlacementConfig(disk_read_bytes_per_s=10**7, pfs_read_bytes_per_s=2 * 10**7,
                                  prefill_tokens_per_s=1000.0),  # 16 ms to recompute, 1.6 / 0.8 ms to load
        replication=ReplicationConfig(mode=mode),
    )


def chunks(n):
    gen = torch.Generator().manual_seed(0)
    keys = chunk_keys(torch.randint(0, 50_000, (n * WIDE_NS.chunk_tokens,), generator=gen).tolist(), WIDE_NS)
    return keys, [torch.randn(WIDE_NS.chunk_shape, generator=gen).half() for _ in keys]


def below_host(store, key) -> set[str]:
    return set(store.replicas([key])[0]) - {"host"}


@pytest.mark.parametrize("mode", ["all", "utility"])
def test_full_tiers_take_one_copy_of_a_typical_chunk_and_room_brings_more(tmp_path, mode):
    keys, values = chunks(8)
    with Store(store_config(tmp_path, mode)) as store:
        for k, v in zip(keys[:4], values[:4]):  # room: both tiers get every chunk
            store.put(k, v)
            store.flush()
        assert all(below_host(store, k) == {"disk", "pfs"} for k in keys[:4])
        for k, v in zip(keys[4:], values[4:]):  # both full now
            store.put(k, v)
            store.flush()
        expected = {"disk", "pfs"} if mode == "all" else {"pfs"}
        assert all(below_host(store, k) == expected for k in keys[4:])
        if mode == "utility":  # the disk keeps the first four; eight distinct chunks below host RAM
            assert sum(bool(below_host(store, k)) for k in keys) == 8
            store.drop([keys[0]], "disk")  # room on the disk again
            assert "host" not in store.replicas([keys[4]])[0]
            assert torch.equal(store.get([keys[4]])[0], values[4])  # read from the PFS, promoted
            store.flush()
            assert below_host(store, keys[4]) == {"disk", "pfs"}


def test_a_durable_put_is_copied_to_every_replica_tier(tmp_path):
    keys, values = chunks(8)
    with Store(store_config(tmp_path, "utility")) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert all(below_host(store, k) == {"disk", "pfs"} for k in keys[4:])
