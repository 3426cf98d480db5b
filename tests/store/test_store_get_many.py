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
