"""Store.read_into: a read whose buffer is taken only once a tier holds the chunk (the daemon
sizes nothing for a chunk a request merely names), a miss counted once by the one call; it
and get_blob find a chunk a peer wrote on a shared tier, as a lookup would."""

import torch

from helpers import NS, chunks, store_config
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.store import Store
from tiers.pfs import PfsTier


def test_the_buffer_is_taken_only_for_a_chunk_a_tier_holds_and_a_miss_counts_once(tmp_path):
    keys, kvs = chunks(2)
    with Store(store_config(tmp_path)) as store:
        store.put(keys[0], kvs[0], durable=True)
        taken = []

        def take():
            taken.append(torch.empty(NS.chunk_shape, dtype=NS.torch_dtype))
            return taken[-1]

        misses = store.stats().misses
        assert not store.read_into(keys[1], take)
        assert taken == [] and store.stats().misses == misses + 1
        assert store.read_into(keys[0], take)
        assert len(taken) == 1 and torch.equal(taken[0], kvs[0])
        store.drop(keys[:1], "host")  # from the disk tier now
        assert store.read_into(keys[0], take)
        assert len(taken) == 2 and torch.equal(taken[1], kvs[0])


def test_a_chunk_a_peer_wrote_on_a_shared_tier_is_read_without_a_lookup_first(tmp_path):
    keys, kvs = chunks(2)
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False),
                         disk=DiskTierConfig(enabled=False))
    with Store(config, extra_tiers=[PfsTier(tmp_path / "pfs", 1 << 20)]) as reader, \
            Store(config, extra_tiers=[PfsTier(tmp_path / "pfs", 1 << 20)]) as writer:
        for key, kv in zip(keys, kvs):
            writer.put(key, kv, durable=True)  # after the reader scanned the mount: it lists neither
        out = torch.empty(NS.chunk_shape, dtype=NS.torch_dtype)
        assert reader.read_into(keys[0], lambda: out) and torch.equal(out, kvs[0])
        blob = reader.get_blob(keys[1])
        assert blob is not None and blob == writer.get_blob(keys[1])
