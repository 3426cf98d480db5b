"""Store.borrow: a raw chunk in host RAM lent as a tensor over its own pages for a ``with``
block (the connector scatters from it: one copy instead of two), or None whenever the bytes
are not there raw and in one piece; what is lent stays put until the block ends."""

import pytest
import torch

from helpers import PAGE, chunks, same, store_config
from kvstore.api import LendsChunks
from kvstore.store.index import StoreClosed
from kvstore.keys import Namespace
from kvstore.store import Store

BIG = Namespace("borrow", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)  # 16 KiB: 5 pages


def test_a_raw_host_chunk_is_lent_and_counted_as_a_hit(tmp_path):
    keys, kvs = chunks(2, BIG)
    with Store(store_config(tmp_path)) as store:
        assert isinstance(store, LendsChunks)
        store.put(keys[0], kvs[0])
        hits = store.stats().tiers["host"].hits
        with store.borrow(keys[0]) as src:
            assert same(src, kvs[0])
        assert store.stats().tiers["host"].hits == hits + 1
        with store.borrow(keys[1]) as src:
            assert src is None


def test_an_encoded_chunk_is_not_lent(tmp_path):
    keys, kvs = chunks(1, BIG)
    with Store(store_config(tmp_path)) as store:
        store.put(keys[0], kvs[0], codec="lz4")
        with store.borrow(keys[0]) as src:
            assert src is None
        out = torch.empty_like(kvs[0])
        assert store.get_into(keys[0], out) and same(out, kvs[0])


def test_a_lent_chunk_stays_put_while_it_is_deleted_and_put_again(tmp_path):
    keys, kvs = chunks(1, BIG)
    other = torch.randn(BIG.chunk_shape).half()
    with Store(store_config(tmp_path, disk=None)) as store:
        store.put(keys[0], kvs[0])
        with store.borrow(keys[0]) as src:
            store.delete(keys)
            store.put(keys[0], other)
            for seed in range(1, 9):  # churn the pool: freed pages would be handed out again
                k, v = chunks(1, BIG, seed=seed)
                store.put(k[0], v[0])
            assert same(src, kvs[0])
        out = torch.empty_like(other)
        assert store.get_into(keys[0], out) and same(out, other)


def test_a_chunk_split_over_pages_is_not_lent_and_reads_whole(tmp_path):
    """One-page chunks fill the pool, every other one is deleted: a 5-page chunk put then
    can only take pages that are not adjacent."""
    small, small_kvs = chunks(32)
    keys, kvs = chunks(1, BIG, seed=5)
    with Store(store_config(tmp_path, host=32 * PAGE, disk=None)) as store:
        for k, v in zip(small, small_kvs):
            store.put(k, v)
        store.delete(small[::2])
        store.put(keys[0], kvs[0])
        assert len(_runs(store, keys[0])) > 1
        with store.borrow(keys[0]) as src:
            assert src is None
        out = torch.empty_like(kvs[0])
        assert store.get_into(keys[0], out) and same(out, kvs[0])


def _runs(store, key):
    with store.host_pool.pinned_runs(key.id) as runs:
        return list(runs)


def test_a_closed_store_lends_nothing(tmp_path):
    keys, kvs = chunks(1, BIG)
    store = Store(store_config(tmp_path))
    store.put(keys[0], kvs[0])
    store.close()
    with pytest.raises(StoreClosed):
        with store.borrow(keys[0]):
            pass


def test_lent_chunks_are_ready_for_a_cpu_and_for_no_device_without_cuda(tmp_path):
    with Store(store_config(tmp_path)) as store:
        assert store.prepare_lending("cpu")
        if not torch.cuda.is_available():
            assert not store.prepare_lending("cuda")
        with pytest.raises(RuntimeError):
            store.prepare_lending("no-such-device")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lent_chunks_are_page_locked_for_a_cuda_device_until_the_store_closes(tmp_path):
    keys, kvs = chunks(2, BIG)
    with Store(store_config(tmp_path)) as store:
        store.put(keys[0], kvs[0])
        with store.borrow(keys[0]) as src:
            assert not src.is_pinned()
        assert store.prepare_lending(torch.device("cuda")) and store.prepare_lending("cuda:0")
        store.put(keys[1], kvs[1])
        for key, kv in zip(keys, kvs):
            with store.borrow(key) as src:
                assert src.is_pinned()  # a host -> device copy from it is DMA, not staged
                on_gpu = src.to("cuda", non_blocking=True)
                torch.cuda.synchronize()
            assert same(on_gpu.cpu(), kv)
    with Store(store_config(tmp_path)) as again:  # the pool was unregistered: registering anew works
        assert again.prepare_lending("cuda")
