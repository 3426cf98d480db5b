"""One request's load (connector/loads.py) against a real in-process Store and a real CPU
paged cache: once ``finish`` has settled a load, nothing writes the request's blocks again,
whatever its loader threads were doing at that moment."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from connector.availability import Availability
from connector.loads import LoadTask
from connector.metadata import ChunkLoad, RequestLoad
from connector.staging import StagingPool
from connector.transfer import ChunkMover
from helpers import NS, chunks, store_config
from kvstore.store import Store

BLOCK = 4  # tokens per block: a chunk of NS (8 tokens) is two blocks


def kv_cache(num_blocks: int) -> torch.Tensor:
    return torch.zeros(NS.num_layers, 2, num_blocks, BLOCK, NS.num_kv_heads, NS.head_dim, dtype=NS.torch_dtype)


def test_a_lent_group_in_flight_when_its_load_settles_writes_no_block_after(tmp_path):
    """A load whose first group came back short is settled while its second group, which the
    store lends, is scattering its first chunk. Before the fix, that scatter's end put the
    group back in READING, which ``finish`` had already passed over, so the loader went on to
    scatter the group's next chunk into blocks the engine had been told failed (and may have
    given to another request)."""
    keys, kvs = chunks(4)
    with Store(store_config(tmp_path)) as store:
        for key, kv in zip(keys[1:], kvs[1:]):  # chunk 0 missing: group 0 comes back short
            store.put(key, kv)
        cache = kv_cache(8)
        mover = ChunkMover(cache)
        in_scatter, let_scatter_end, settled = threading.Event(), threading.Event(), threading.Event()
        late_writes = []
        scatter = mover.scatter

        def gated_scatter(buf, load):
            if load.key == keys[2]:
                in_scatter.set()
                assert let_scatter_end.wait(10)
            if settled.is_set():
                late_writes.append(load.key)
            scatter(buf, load)

        mover.scatter = gated_scatter
        borrow = store.borrow

        def gated_borrow(key):
            if key == keys[3]:
                assert settled.wait(10)  # the next chunk is borrowed only once the load is settled
            return borrow(key)

        store.borrow = gated_borrow
        cond = threading.Condition()
        request = RequestLoad("r", 0, [ChunkLoad(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])
        task = LoadTask(request, store, StagingPool(NS.chunk_shape, NS.torch_dtype, False, keep=4), mover,
                        Availability(30), cond, chunks_per_read=2, timeout_s=30, layerwise=False)
        assert task.lends
        pool = ThreadPoolExecutor(2)
        task.submit(pool)
        assert in_scatter.wait(10)
        with cond:
            assert task.known()  # group 0 is short: the result can no longer grow

            def end_scatter_once_finish_waits():
                with cond:  # acquired only while ``finish`` waits on the condition
                    let_scatter_end.set()

            threading.Thread(target=end_scatter_once_finish_waits).start()
            result = task.finish()
        assert result.loaded_chunks == 0 and set(result.failed_block_ids) == set(range(8))
        cache.zero_()  # the engine recomputes these blocks, or hands them to another request
        settled.set()
        pool.shutdown(wait=True)
        assert late_writes == [] and not cache.any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("lends_to_gpu", [True, False], ids=["lent", "staged"])
def test_a_load_into_a_gpu_cache_borrows_host_ram_registered_for_it_else_stages(tmp_path, lends_to_gpu):
    keys, kvs = chunks(6)
    with Store(store_config(tmp_path)) as store:
        for key, kv in zip(keys, kvs):
            store.put(key, kv)
        assert store.prepare_lending("cuda")
        cache = kv_cache(12).cuda()
        staging = StagingPool(NS.chunk_shape, NS.torch_dtype, True, keep=4)
        taken, take = [], staging.take
        staging.take = lambda: taken.append(1) or take()
        cond = threading.Condition()
        request = RequestLoad("r", 0, [ChunkLoad(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])
        task = LoadTask(request, store, staging, ChunkMover(cache), Availability(30), cond, chunks_per_read=2,
                        timeout_s=30, layerwise=False, lends_to_gpu=lends_to_gpu)
        assert task.lends == lends_to_gpu
        with ThreadPoolExecutor(2) as pool:
            task.submit(pool, here=True)
            with cond:
                task.wait()
                result = task.finish()
        assert result.loaded_chunks == 6 and not result.failed_block_ids
        assert len(taken) == (0 if lends_to_gpu else 6)
        for i, kv in enumerate(kvs):
            assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3).cpu(), kv)
