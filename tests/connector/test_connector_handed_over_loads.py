"""Loads from a real daemon through ``Client.get_with`` (connector/loads.py, the path vLLM's
synchronous loads take on the daemon's host): chunks are scattered into a CPU paged cache
straight from the daemon's host pool, never through a staging buffer, and once ``finish`` has
settled a load nothing writes its blocks again."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from connector.availability import Availability
from connector.loads import LoadTask
from connector.metadata import ChunkLoad, RequestLoad
from connector.staging import StagingPool
from connector.transfer import ChunkMover
from kv_daemon import start_daemon
from kvstore.client import Client
from tests.helpers import NS, chunks

BLOCK = 4  # tokens per block: a chunk of NS (8 tokens) is two blocks


@pytest.fixture
def client(tmp_path):
    daemon = start_daemon(tmp_path / "daemon")
    with Client(daemon.addr, token_file=daemon.token_file) as c:
        yield c
    daemon.stop()


def kv_cache(num_blocks: int) -> torch.Tensor:
    return torch.zeros(NS.num_layers, 2, num_blocks, BLOCK, NS.num_kv_heads, NS.head_dim, dtype=NS.torch_dtype)


def no_staging() -> StagingPool:
    return StagingPool(NS.chunk_shape, NS.torch_dtype, False, keep=0, limit=0)  # any take() is None


def task_for(keys, client, mover, cond) -> LoadTask:
    request = RequestLoad("r", 0, [ChunkLoad(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])
    return LoadTask(request, client, no_staging(), mover, Availability(30), cond, chunks_per_read=2, timeout_s=30,
                    layerwise=False)


def test_chunks_land_in_their_blocks_without_a_staging_buffer(client):
    keys, kvs = chunks(3)
    for key, kv in zip(keys, kvs):
        client.put(key, kv)
    cache = kv_cache(6)
    cond = threading.Condition()
    task = task_for(keys, client, ChunkMover(cache), cond)
    assert task.hands_over and not task.lends
    with ThreadPoolExecutor(2) as pool:
        task.submit(pool, here=True)
        with cond:
            task.wait()
            result = task.finish()
    assert result.loaded_chunks == 3 and result.failed_block_ids == ()
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3), kv)


def test_a_group_scattering_when_its_load_settles_writes_no_block_after(client):
    """Group 0 comes back short (its first chunk is missing), so the load is settled while
    group 1 is scattering its first chunk; the daemon has handed over its second already, and
    it must not be scattered into blocks the engine was told failed."""
    keys, kvs = chunks(4, seed=1)
    for key, kv in zip(keys[1:], kvs[1:]):
        client.put(key, kv)
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
    cond = threading.Condition()
    task = task_for(keys, client, mover, cond)
    pool = ThreadPoolExecutor(2)
    task.submit(pool)
    assert in_scatter.wait(10)
    with cond:
        task.wait()  # group 0 short: the result can no longer grow

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
