"""The replica ledger behind per-tenant quotas: on its own, and fed by a real Store's hooks
(what it says a tier holds is what the tier holds, through puts, evictions, copies and deletes)."""

import torch

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store.quota import ReplicaUsage
from kvstore.store import Store

A = Namespace("quota", 2, 2, 32, chunk_tokens=32, tenant="a")  # 16 KiB fp16
B = Namespace("quota", 2, 2, 32, chunk_tokens=32, tenant="b")


def keys(ns, n, start=0):
    return chunk_keys(list(range(start, start + n * 32)), ns)


def test_the_ledger_counts_per_owner_and_gives_the_oldest_first():
    usage = ReplicaUsage(["host", "disk"])
    a, b = keys(A, 4), keys(B, 2)
    for i, k in enumerate(a):
        usage.added("host", k.id, 100 + i)
    usage.added("host", b[0].id, 1000)
    usage.added("pfs", b[1].id, 1000)  # a tier nobody tracks
    assert usage.used("alice", "host") == 0  # nothing assigned yet
    usage.assign(A, "alice")
    usage.assign(B, "bob")
    assert usage.used("alice", "host") == 100 + 101 + 102 + 103 and usage.used("bob", "host") == 1000
    usage.added("host", a[0].id, 50)  # re-encoded: a new size, and now the newest
    assert usage.used("alice", "host") == 50 + 101 + 102 + 103
    assert usage.oldest("alice", "host") == [(a[1].id, 101), (a[2].id, 102), (a[3].id, 103), (a[0].id, 50)]
    assert usage.oldest("alice", "host", 150) == [(a[1].id, 101), (a[2].id, 102)]
    assert usage.oldest("alice", "host", 150, at_least=3) == [(a[1].id, 101), (a[2].id, 102), (a[3].id, 103)]
    assert usage.oldest("alice", "host", 150, skip=a[1].id) == [(a[2].id, 102), (a[3].id, 103)]
    usage.removed("host", a[1].id)
    usage.removed("host", a[1].id)  # twice: no harm
    assert usage.used("alice", "host") == 50 + 102 + 103 and usage.holds("host", a[2].id)
    assert not usage.holds("disk", a[2].id) and usage.used("alice", "disk") == 0


def test_a_stores_hooks_keep_the_ledger_equal_to_its_tiers(tmp_path):
    usage = ReplicaUsage(["host", "disk"])
    config = StoreConfig(host=HostTierConfig(capacity_bytes=512 << 10, page_bytes=4096, prefault=False),
                         disk=DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 20))
    usage.assign(A, "alice")
    value = torch.ones(A.chunk_shape, dtype=torch.float16)
    with Store(config, usage=usage) as store:
        ks = keys(A, 100)  # 1.6 MB: evicts from host and from disk
        for i, k in enumerate(ks):
            store.put(k, value, durable=i % 3 == 0, codec="lz4" if i % 5 == 0 else None)
        store.flush()
        store.delete(ks[90:95])
        for tier in store.tiers:
            held = set(tier.keys())
            assert {k.id for k in ks if usage.holds(tier.name, k.id)} == held
            assert usage.used("alice", tier.name) == sum(tier.size_of(k) for k in held)
    reopened = ReplicaUsage(["host", "disk"])
    with Store(config, usage=reopened) as store:  # recovery reports what the disk holds
        reopened.assign(A, "alice")
        assert reopened.used("alice", "disk") == usage.used("alice", "disk") > 0
