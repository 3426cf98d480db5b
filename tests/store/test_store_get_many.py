import pytest
import torch

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store


def test_store_get_many_into_fills_reused_buffers(tmp_path):
    ns = Namespace("reuse", 2, 1, 16, chunk_tokens=16)
    keys = chunk_keys(list(range(64)), ns)
    values = [torch.randn(ns.chunk_shape).half() for _ in keys]
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False),
                      disk=DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 20))
    with Store(cfg) as store:
        for k, v in zip(keys[:3], values[:3]):
            store.put(k, v)
        outs = [torch.zeros(ns.chunk_shape, dtype=torch.float16) for _ in keys]
        assert store.get_many_into(keys, outs) == 3
        assert all(torch.equal(o, v) for o, v in zip(outs[:3], values[:3]))
        assert not outs[3].any()


LENT_NS = Namespace("lent", 2, 1, 16, chunk_tokens=16)


def _ram_and_disk(tmp_path, verify: bool = False) -> StoreConfig:
    return StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False,
                                           verify_payload=verify),
                       disk=DiskTierConfig(path=str(tmp_path), capacity_bytes=1 << 20))


def _copies_of_lent_chunks(monkeypatch) -> list[int]:
    """How many pool ranges each copy of lent chunks read (ReadPath.copy_lent)."""
    from tiers.host import HostTier

    seen = []
    real = HostTier.read_runs_into

    def counted(tier, runs, outs):
        seen.append(sum(len(r) for r in runs))
        real(tier, runs, outs)

    monkeypatch.setattr(HostTier, "read_runs_into", counted)
    return seen


@pytest.mark.parametrize("verify", [False, True])
def test_get_many_into_copies_the_leading_raw_host_chunks_together_and_streams_the_rest(tmp_path, monkeypatch, verify):
    """A copy of many MiB empties the caches: the leading chunks in host RAM are pinned,
    checked and counted first, copied in one go, then released; the rest (here one only on
    disk, then one only in RAM) are read one by one. Where host RAM verifies payloads, a
    lend would hash in a pass of its own: every chunk is read, hashed as it is copied."""
    keys = chunk_keys(list(range(4 * LENT_NS.chunk_tokens)), LENT_NS)
    values = [torch.randn(LENT_NS.chunk_shape).half() for _ in keys]
    with Store(_ram_and_disk(tmp_path, verify)) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert store.drop(keys[2:3], "host") == 1
        assert store.drop(keys[3:], "disk") == 1  # else the fetch may read it from either tier
        host_hits, disk_hits = store.stats().tiers["host"].hits, store.stats().tiers["disk"].hits
        copies = _copies_of_lent_chunks(monkeypatch)
        outs = [torch.zeros(LENT_NS.chunk_shape, dtype=torch.float16) for _ in keys]
        assert store.get_many_into(keys, outs) == 4
        assert all(torch.equal(o, v) for o, v in zip(outs, values))
        assert copies == ([] if verify else [2])  # one copy, of one range a chunk (each lies in one run)
        stats = store.stats()
        assert (stats.tiers["host"].hits, stats.tiers["disk"].hits) == (host_hits + 3, disk_hits + 1)
        store.delete(keys)
        assert stats.pinned == 0 and store.stats().tiers["host"].used_bytes == 0, "a pin is still held"


def test_get_into_copies_a_raw_host_chunk_lent_and_decodes_an_encoded_one(tmp_path, monkeypatch):
    keys = chunk_keys(list(range(2 * LENT_NS.chunk_tokens)), LENT_NS)
    values = [torch.randn(LENT_NS.chunk_shape).half() for _ in keys]
    with Store(_ram_and_disk(tmp_path)) as store:
        store.put(keys[0], values[0])
        store.put(keys[1], values[1], codec="int8")
        copies = _copies_of_lent_chunks(monkeypatch)
        out = torch.zeros(LENT_NS.chunk_shape, dtype=torch.float16)
        assert store.get_into(keys[0], out) and torch.equal(out, values[0])
        assert copies == [1]
        assert store.get_into(keys[1], out) and (out - values[1]).abs().max() < 0.1
        assert copies == [1]
        assert not store.get_into(chunk_keys(list(range(100, 100 + LENT_NS.chunk_tokens)), LENT_NS)[0], out)
        store.delete(keys)
        assert store.stats().tiers["host"].used_bytes == 0, "a pin is still held"
