"""Owners kept within their quotas by the Store itself (kvstore/store/owner_quota.py): a put
makes room among its owner's own chunks, those the tier's eviction policy ranks lowest, a promotion only moves out of host RAM the
owner's chunks a lower tier holds, and a chunk larger than a quota is refused."""

import pytest
import torch

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from kvstore.store.owner_quota import QuotaExceeded
from kvstore.store.quota import ReplicaUsage

A = Namespace("owner-quota", 2, 2, 32, chunk_tokens=32, tenant="a")  # 16 KiB fp16
B = Namespace("owner-quota", 2, 2, 32, chunk_tokens=32, tenant="b")
PAGE = 4096
CHUNK = 5 * PAGE  # what one raw blob (16 KiB + its header) occupies in host RAM


def keys(ns, n):
    return chunk_keys(list(range(n * 32)), ns)


def value(i: int) -> torch.Tensor:
    return torch.full(A.chunk_shape, float(i), dtype=torch.float16)


def owned_store(tmp_path, host_quota: int, disk: bool, policy: str = "default") -> tuple[Store, ReplicaUsage]:
    usage = ReplicaUsage(["host", "disk"])
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=PAGE, prefault=False),
                         disk=DiskTierConfig(enabled=disk, path=str(tmp_path), capacity_bytes=4 << 20),
                         eviction_policy=policy)
    store = Store(config, usage=usage)
    usage.measure({t.name: t.footprint for t in store.tiers})
    usage.assign(A, "alice")
    usage.assign(B, "bob")
    usage.set_quotas("alice", {"host": host_quota})
    return store, usage


def test_a_put_over_its_owners_quota_replaces_that_owners_oldest_chunks_only(tmp_path):
    store, usage = owned_store(tmp_path, 4 * CHUNK, disk=False)
    with store:
        theirs, mine = keys(B, 3), keys(A, 10)
        for i, k in enumerate(theirs):
            store.put(k, value(i))
        for i, k in enumerate(mine):
            store.put(k, value(i))
            assert usage.used("alice", "host") <= 4 * CHUNK
        assert [store.contains(k) for k in mine] == [False] * 6 + [True] * 4
        assert all(store.contains(k) for k in theirs) and usage.used("bob", "host") == 3 * CHUNK
        store.check_integrity()


@pytest.mark.parametrize("policy", ["default", "lru"])
def test_an_owner_at_its_quota_keeps_the_chunk_it_reads_and_loses_the_one_its_policy_ranks_last(tmp_path, policy):
    """The oldest chunk put, read before every new put (a shared system prompt), stays; the
    chunks never read leave, the first put first. Before, quotas evicted the oldest put,
    whatever the reads."""
    store, usage = owned_store(tmp_path, 3 * CHUNK, disk=False, policy=policy)
    with store:
        prompt, *rest = keys(A, 8)
        store.put(prompt, value(0))
        out = torch.empty(A.chunk_shape, dtype=torch.float16)
        for i, k in enumerate(rest, 1):
            assert store.get_into(prompt, out) and torch.equal(out, value(0))
            store.put(k, value(i))
            assert usage.used("alice", "host") <= 3 * CHUNK
        assert [store.contains(k) for k in [prompt, *rest]] == [True] + [False] * 5 + [True] * 2
        store.check_integrity()


def test_a_put_at_its_quota_ranks_its_owners_oldest_chunks_not_all_it_holds(tmp_path, monkeypatch):
    """Each put at the quota frees one chunk: the policy ranks a window of the owner's oldest
    chunks (``MIN_CANDIDATES`` here), not every chunk the owner holds."""
    from kvstore.store import owner_quota

    store, usage = owned_store(tmp_path, 40 * CHUNK, disk=False)
    monkeypatch.setattr(owner_quota, "MIN_CANDIDATES", 8)
    ranked = []
    with store:
        order = store.index.eviction_order
        monkeypatch.setattr(store.index, "eviction_order", lambda tier, ids: ranked.append(len(ids)) or order(tier, ids))
        mine = keys(A, 50)
        for i, k in enumerate(mine):
            store.put(k, value(i))
        assert len(ranked) == 10 and max(ranked) == 8
        assert [store.contains(k) for k in mine] == [False] * 10 + [True] * 40
        store.check_integrity()


def test_a_promotion_moves_only_chunks_a_lower_tier_holds_and_deletes_nothing(tmp_path):
    """Reads from disk promote into host RAM; each first makes room by moving the owner's own
    chunks that are on disk out of host RAM, so every chunk stays readable and the owner stays
    within its quota, and another owner's chunk is never touched."""
    store, usage = owned_store(tmp_path, 2 * CHUNK, disk=True)
    with store:
        (theirs,) = keys(B, 1)
        store.put(theirs, value(99))
        mine = keys(A, 6)
        for i, k in enumerate(mine):
            store.put(k, value(i), durable=True)  # on disk, synced, before the next put
        assert usage.used("alice", "host") <= 2 * CHUNK and usage.used("alice", "disk") > 0
        for _ in range(2):
            for i, k in enumerate(mine):
                out = torch.empty(A.chunk_shape, dtype=torch.float16)
                assert store.get_into(k, out) and torch.equal(out, value(i))
                assert usage.used("alice", "host") <= 2 * CHUNK
        assert store.lookup(mine) == 6
        assert theirs.id in set(store.tier("host").keys())
        store.check_integrity()


def test_a_chunk_larger_than_its_owners_quota_is_refused(tmp_path):
    store, usage = owned_store(tmp_path, PAGE, disk=False)
    with store:
        (k,) = keys(A, 1)
        with pytest.raises(QuotaExceeded, match="quota"):
            store.put(k, value(1))
        assert not store.contains(k) and usage.used("alice", "host") == 0
