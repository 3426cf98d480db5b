"""Loads from a real daemon through ``Client.get_with`` (connector/loads.py, the path vLLM's
synchronous loads take on the daemon's host): chunks are scattered into a CPU paged cache
straight from the daemon's host pool, never through a staging buffer, a synchronous load's on
the engine's own thread, and once ``finish`` has settled a load nothing writes its blocks
again."""

import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor

import pytest
import torch

from connector.availability import Availability
from connector.loads import LoadTask
from connector.metadata import ChunkLoad, RequestLoad
from connector.staging import StagingPool
from connector.transfer import ChunkMover
from helpers import NS, chunks
from kv_daemon import start_daemon
from kvstore.client import Client
from kvstore.keys import Namespace

BLOCK = 4  # tokens per block: a chunk of NS (8 tokens) is two blocks
NS_FIELDS = {f: getattr(NS, f) for f in ("model_id", "num_layers", "num_kv_heads", "head_dim", "dtype", "chunk_tokens")}


def daemon_client(tmp_path, **options):
    daemon = start_daemon(tmp_path / "daemon")
    with Client(daemon.addr, token_file=daemon.token_file, **options) as c:
        yield c
    daemon.stop()


@pytest.fixture
def client(tmp_path):
    yield from daemon_client(tmp_path)


@pytest.fixture
def remote(tmp_path):
    yield from daemon_client(tmp_path, transport="remote")


def kv_cache(num_blocks: int) -> torch.Tensor:
    return torch.zeros(NS.num_layers, 2, num_blocks, BLOCK, NS.num_kv_heads, NS.head_dim, dtype=NS.torch_dtype)


def no_staging() -> StagingPool:
    return StagingPool(NS.chunk_shape, NS.torch_dtype, False, keep=0, limit=0)  # any take() is None


def task_for(keys, client, mover, cond) -> LoadTask:
    request = RequestLoad("r", 0, [ChunkLoad(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])
    return LoadTask(request, client, no_staging(), mover, Availability(30), cond, chunks_per_read=2, timeout_s=30,
                    layerwise=False)


class NoThreads(Executor):
    """A loader pool a load must not use."""

    def submit(self, fn, /, *args, **kwargs):
        raise AssertionError("a synchronous handed-over load used a loader thread")


def settle(task: LoadTask, cond: threading.Condition):
    with cond:
        task.wait()
        return task.finish()


def recording_scatters(mover: ChunkMover) -> list[tuple[int, object]]:
    """(thread, key) of every scatter ``mover`` makes from now on."""
    seen = []
    scatter = mover.scatter

    def recorded(buf, load):
        seen.append((threading.get_ident(), load.key))
        scatter(buf, load)

    mover.scatter = recorded
    return seen


def recording_reads(client: Client) -> list[list]:
    """The keys of every ``get_with`` call ``client`` makes from now on."""
    reads = []
    get_with = client.get_with

    def recorded(keys, consume):
        reads.append(list(keys))
        return get_with(keys, consume)

    client.get_with = recorded
    return reads


def test_chunks_land_in_their_blocks_without_a_staging_buffer(client):
    """On the loader threads (an asynchronous load)."""
    keys, kvs = chunks(3)
    for key, kv in zip(keys, kvs):
        client.put(key, kv)
    cache = kv_cache(6)
    cond = threading.Condition()
    task = task_for(keys, client, ChunkMover(cache), cond)
    assert task.hands_over and not task.lends
    with ThreadPoolExecutor(2) as pool:
        task.submit(pool)
        result = settle(task, cond)
    assert result.loaded_chunks == 3 and result.failed_block_ids == ()
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3), kv)


def test_a_synchronous_load_reads_and_scatters_on_the_calling_thread(client):
    """vLLM's CPU Worker computes its forward with the OpenMP threads of its own thread; a
    copy on a loader thread ran on a second team of them, which slowed every later forward.
    A synchronous load is read and scattered before ``submit`` returns, on the caller's
    thread, in order, in one read call (one round trip); no loader thread is used."""
    keys, kvs = chunks(5, seed=2)
    for key, kv in zip(keys, kvs):
        client.put(key, kv)
    cache = kv_cache(10)
    mover = ChunkMover(cache)
    seen = recording_scatters(mover)
    reads = recording_reads(client)
    cond = threading.Condition()
    task = task_for(keys, client, mover, cond)
    task.submit(NoThreads(), here=True)
    assert task.known()  # in place when submit returns: nothing left to wait for
    result = settle(task, cond)
    assert result.loaded_chunks == 5 and result.failed_block_ids == ()
    assert seen == [(threading.get_ident(), k) for k in keys] and reads == [keys]
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3), kv)


def test_a_synchronous_load_from_a_remote_daemon_runs_on_the_loader_threads(remote):
    """Over the socket the Client receives a read call whole before handing its chunks over:
    on the engine's thread alone, receiving and scattering took turns, and the connector's
    load from a remote daemon fell from 1.9 to 1.5-1.6 GB/s (docs/benchmarks.md). There the
    loader threads overlap one group's receiving with another's scattering."""
    assert not remote.hands_over_in_place()
    keys, kvs = chunks(4, seed=6)
    for key, kv in zip(keys, kvs):
        remote.put(key, kv)
    cache = kv_cache(8)
    mover = ChunkMover(cache)
    seen = recording_scatters(mover)
    cond = threading.Condition()
    task = task_for(keys, remote, mover, cond)
    with ThreadPoolExecutor(2) as pool:
        task.submit(pool, here=True)
        result = settle(task, cond)
    assert result.loaded_chunks == 4 and result.failed_block_ids == ()
    assert sorted(k.id for _, k in seen) == sorted(k.id for k in keys)
    assert all(thread != threading.get_ident() for thread, _ in seen)
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3), kv)


def test_a_synchronous_loads_read_calls_hold_at_most_here_read_bytes(client, monkeypatch):
    """Where the Client receives a call's chunks before handing them over, one call of a long
    prompt would hold all its KV at once: calls are cut at ``HERE_READ_BYTES``."""
    monkeypatch.setattr("connector.loads.HERE_READ_BYTES", 2 * NS.chunk_bytes + 1)
    keys, kvs = chunks(5, seed=4)
    for key, kv in zip(keys, kvs):
        client.put(key, kv)
    cache = kv_cache(10)
    mover = ChunkMover(cache)
    reads = recording_reads(client)
    cond = threading.Condition()
    task = task_for(keys, client, mover, cond)
    task.submit(NoThreads(), here=True)
    result = settle(task, cond)
    assert result.loaded_chunks == 5 and reads == [keys[:2], keys[2:4], keys[4:]]
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3), kv)


def test_a_synchronous_load_stops_at_the_first_missing_chunk(client):
    """Chunk 2 is missing: chunks 0 and 1 are loaded, and chunks 3 and 4, though stored, are
    not scattered, since a load is a prefix of the request's chunks."""
    keys, kvs = chunks(5, seed=3)
    for i, (key, kv) in enumerate(zip(keys, kvs)):
        if i != 2:
            client.put(key, kv)
    cache = kv_cache(10)
    mover = ChunkMover(cache)
    seen = recording_scatters(mover)
    cond = threading.Condition()
    task = task_for(keys, client, mover, cond)
    task.submit(NoThreads(), here=True)
    result = settle(task, cond)
    assert [k for _, k in seen] == keys[:2]
    assert result.loaded_chunks == 2 and set(result.failed_block_ids) == set(range(4, 10))
    assert not cache[:, :, 4:].any()


def test_a_synchronous_load_past_its_deadline_starts_no_further_read(client):
    """A request's chunks and then a chunk of another namespace (a session's tail): two read
    calls. The deadline passes while the first is scattering: the second is not made, and the
    load is reported timed out with the first call's chunks in place (as a load on the loader
    threads is)."""
    keys, kvs = chunks(2, seed=4)
    (tail,), (tail_kv,) = chunks(1, Namespace(**{**NS_FIELDS, "tenant": "session"}), seed=5)
    for key, kv in zip(keys + [tail], kvs + [tail_kv]):
        client.put(key, kv)
    cache = kv_cache(6)
    mover = ChunkMover(cache)
    cond = threading.Condition()
    task = task_for(keys + [tail], client, mover, cond)
    reads = recording_reads(client)
    scatter = mover.scatter

    def scatter_then_expire(buf, load):
        scatter(buf, load)
        task.deadline = time.monotonic()  # the load's time is up once this chunk is in

    mover.scatter = scatter_then_expire
    task.submit(NoThreads(), here=True)
    result = settle(task, cond)
    assert reads == [keys]
    assert result.timed_out and result.loaded_chunks == 2 and set(result.failed_block_ids) == {4, 5}


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


def test_a_load_into_a_gpu_cache_is_staged_unless_the_shared_memory_is_registered_for_it(client):
    """Into a GPU cache, chunks are handed over only from the daemon's memory registered with
    CUDA (a DMA source); anywhere else (no CUDA here) the load goes through staging buffers."""
    keys, kvs = chunks(4)
    for key, kv in zip(keys, kvs):
        client.put(key, kv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    cache = kv_cache(8).to(device)
    mover = ChunkMover(cache)
    if device == "cpu":  # what a GPU cache chooses; the copies themselves run on the CPU
        mover.cuda, mover.device = True, torch.device("cuda")
    staging = StagingPool(NS.chunk_shape, NS.torch_dtype, torch.cuda.is_available(), keep=4)
    taken, take = [], staging.take
    staging.take = lambda: taken.append(1) or take()
    cond = threading.Condition()
    request = RequestLoad("r", 0, [ChunkLoad(k, (2 * i, 2 * i + 1)) for i, k in enumerate(keys)])
    task = LoadTask(request, client, staging, mover, Availability(30), cond, chunks_per_read=2, timeout_s=30,
                    layerwise=False)
    registered = client.hands_over_in_place(torch.device("cuda"))
    assert registered == torch.cuda.is_available() and task.hands_over == registered
    with ThreadPoolExecutor(2) as pool:
        task.submit(pool, here=True)
        result = settle(task, cond)
    assert result.loaded_chunks == 4 and len(taken) == (0 if registered else 4)
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3).cpu(), kv)
    if registered:
        seen = []
        client.get_with(keys[:1], lambda i, src: seen.append(src.is_pinned()) or True)
        assert seen == [True]  # a host -> device copy from it is DMA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_synchronous_handed_over_load_into_a_gpu_cache_runs_on_the_loader_threads(client):
    """Into a GPU cache a synchronous load's groups go to the loader threads, each copying on
    its own stream: on the calling thread alone one stream idles the link between copies
    (30 of 55 GB/s on an H200)."""
    keys, kvs = chunks(6)
    for key, kv in zip(keys, kvs):
        client.put(key, kv)
    cache = kv_cache(12).cuda()
    mover = ChunkMover(cache)
    seen = recording_scatters(mover)
    assert client.hands_over_in_place(torch.device("cuda"))
    cond = threading.Condition()
    task = task_for(keys, client, mover, cond)
    with ThreadPoolExecutor(3) as pool:
        task.submit(pool, here=True)
        result = settle(task, cond)
    assert result.loaded_chunks == 6 and task.hands_over
    assert threading.get_ident() not in {thread for thread, _ in seen}
    for i, kv in enumerate(kvs):
        assert torch.equal(cache[:, :, 2 * i:2 * i + 2].flatten(2, 3).cpu(), kv)
