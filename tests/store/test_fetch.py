import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, WriteBehindConfig
from kvstore.store.fetch import FetchJob
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.disk import DiskTier
from tiers.throttle import ThrottledTier

PAGE = 4096
FETCH_NS = Namespace("fetch-test", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)  # 16 KiB chunks


def run_job(job, tiers, workers=2):
    pool = ThreadPoolExecutor(len(tiers) * workers)
    for t in tiers:
        for _ in range(workers):
            pool.submit(job.work, t)
    out = list(job.results())
    pool.shutdown(wait=True)
    return out


def test_job_delivers_in_order_and_uses_every_tier():
    n = 40
    outs = [torch.zeros(1) for _ in range(n)]
    slow_started = threading.Event()

    def read(tier, i, out):
        if tier == "slow":
            slow_started.set()
        else:
            slow_started.wait(5)  # both tiers are busy at once, however the threads are scheduled
        time.sleep(0.001)
        out.fill_(i)
        return True

    job = FetchJob([frozenset({"fast", "slow"})] * n, outs, read, stall_s=5)
    got = run_job(job, ["fast", "slow"])
    assert [int(t.item()) for t in got] == list(range(n))
    assert job.reads_by_tier["fast"] > 0 and job.reads_by_tier["slow"] > 0
    assert sum(job.reads_by_tier.values()) == n


def test_job_respects_which_tier_holds_what():
    replicas = [frozenset({"a"}), frozenset({"b"}), frozenset({"a", "b"}), frozenset({"b"})]
    calls = []

    def read(tier, i, out):
        calls.append((tier, i))
        assert tier in replicas[i]
        out.fill_(i)
        return True

    got = run_job(FetchJob(replicas, [torch.zeros(1) for _ in replicas], read, 5), ["a", "b"])
    assert len(got) == 4


def test_failed_replica_is_retried_elsewhere_and_all_failed_ends_the_prefix():
    def read(tier, i, out):
        out.fill_(i)
        return not (tier == "a" and i == 1) and i != 3

    outs = [torch.zeros(1) for _ in range(6)]
    job = FetchJob([frozenset({"a", "b"})] * 6, outs, read, 5)
    got = run_job(job, ["a", "b"])
    assert [int(t.item()) for t in got] == [0, 1, 2]


def test_stalled_tier_loses_its_chunk_to_another_replica():
    release = threading.Event()

    def read(tier, i, out):
        if tier == "stuck":
            release.wait(5)
            return False
        out.fill_(i)
        return True

    replicas = [frozenset({"stuck"}), frozenset({"stuck", "ok"})]
    outs = [torch.zeros(1), torch.zeros(1)]
    job = FetchJob(replicas, outs, read, stall_s=0.05)
    pool = ThreadPoolExecutor(2)
    pool.submit(job.work, "stuck")
    pool.submit(job.work, "ok")
    time.sleep(0.01)
    results = job.results()
    # chunk 0 only lives on the stuck tier: once it fails, nothing after it is delivered
    release.set()
    assert list(results) == []
    pool.shutdown(wait=True)

    release.clear()
    job = FetchJob([frozenset({"stuck", "ok"})] * 3, [torch.zeros(1) for _ in range(3)], read, stall_s=0.05)
    pool = ThreadPoolExecutor(2)
    pool.submit(job.work, "stuck")
    pool.submit(job.work, "ok")
    got = list(job.results())
    release.set()
    pool.shutdown(wait=True)
    assert [int(t.item()) for t in got] == [0, 1, 2]
    assert job.reads_by_tier == {"ok": 3}


def make_store(tmp_path, caps=(None, None), stall_s=0.5):
    cfg = StoreConfig(
        host=HostTierConfig(capacity_bytes=256 * PAGE, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=1 << 24, read_bytes_per_s=caps[0] or 0),
        write_behind=WriteBehindConfig(max_pending_bytes=64 * PAGE),
        promote_on_read=False,
        fetch_stall_s=stall_s,
    )
    pfs: object = DiskTier(tmp_path / "pfs", 1 << 24, name="pfs")
    if caps[1]:
        pfs = ThrottledTier(pfs, caps[1])
    return Store(cfg, extra_tiers=[pfs], extra_fetch_workers={"pfs": 2})


def put_replicated(store, n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 1000, (n * FETCH_NS.chunk_tokens,), generator=gen).tolist(), FETCH_NS)
    values = [torch.randn(FETCH_NS.chunk_shape, generator=gen).half() for _ in keys]
    for k, v in zip(keys, values):
        store.put(k, v, durable=True)
    store.drop(keys, "host")
    return keys, values


def test_store_stream_reads_from_both_lower_tiers(tmp_path):
    with make_store(tmp_path, caps=(2e6, 3e6)) as store:  # ~0.1 s per tier: both surely take part
        keys, values = put_replicated(store, 24)
        assert all(r == {"disk", "pfs"} for r in store.replicas(keys))
        got = list(store.stream(keys))
        assert len(got) == 24 and all(torch.equal(a, b) for a, b in zip(got, values))
        stats = store.stats().tiers
        assert stats["disk"].hits > 0 and stats["pfs"].hits > 0
        assert stats["disk"].hits + stats["pfs"].hits == 24
        assert stats["disk"].read_gbps > 0 and stats["pfs"].read_gbps > 0
        only = list(store.stream(keys, tiers=["pfs"]))
        assert len(only) == 24 and store.stats().tiers["pfs"].hits == stats["pfs"].hits + 24
        with pytest.raises(ValueError, match="unknown tiers"):
            list(store.stream(keys, tiers=["tape"]))


def test_tier_disappearing_mid_read_is_invisible_to_the_caller(tmp_path):
    with make_store(tmp_path, caps=(5e6, None)) as store:
        keys, values = put_replicated(store, 16)
        stream = store.stream(keys)
        first = next(stream)
        shutil.rmtree(tmp_path / "pfs")
        rest = list(stream)
        got = [first] + rest
        assert len(got) == 16 and all(torch.equal(a, b) for a, b in zip(got, values))


def test_corrupt_replica_is_dropped_and_the_other_used(tmp_path):
    def corrupt(tier_name, key):
        path = store.tier(tier_name).path_of(key.id)
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x10
        path.write_bytes(bytes(raw))

    with make_store(tmp_path) as store:
        keys, values = put_replicated(store, 4)
        corrupt("disk", keys[1])
        assert len(list(store.stream(keys, tiers=["disk"]))) == 1
        assert store.stats().tiers["disk"].corruptions == 1
        got = store.get(keys)
        assert len(got) == 4 and torch.equal(got[1], values[1])
        assert store.replicas(keys)[1] == {"pfs"}
        corrupt("pfs", keys[1])
        assert len(store.get(keys)) == 1  # no good replica of chunk 1 is left
        assert store.stats().tiers["pfs"].corruptions == 1
        assert store.lookup(keys) == 1


def test_slow_tier_loses_chunks_to_the_fast_one(tmp_path):
    with make_store(tmp_path, caps=(None, 2e5), stall_s=0.02) as store:
        keys, values = put_replicated(store, 8)
        got = store.get(keys)
        assert len(got) == 8 and all(torch.equal(a, b) for a, b in zip(got, values))


def test_reads_of_one_chunk_each_at_once_spread_over_the_replicas(tmp_path):
    """A daemon's Gets read one chunk each, many at once: a read that finds every fetch
    worker of the fastest tier busy takes another replica instead of queueing there."""
    from faults import Call, FaultyTier, Gate

    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=256 * PAGE, page_bytes=PAGE, prefault=False),
                      disk=DiskTierConfig(enabled=False), write_behind=WriteBehindConfig(max_pending_bytes=64 * PAGE),
                      promote_on_read=False)
    fast = FaultyTier(DiskTier(tmp_path / "fast", 1 << 24, name="fast"))
    slow = DiskTier(tmp_path / "slow", 1 << 24, name="slow")
    with Store(cfg, extra_tiers=[fast, slow], extra_fetch_workers={"fast": 1, "slow": 1}) as store:
        keys, values = put_replicated(store, 2)
        gate = fast.gates["read"] = Gate(key=keys[0].id)
        first, second = torch.empty(FETCH_NS.chunk_shape).half(), torch.empty(FETCH_NS.chunk_shape).half()
        held = Call(lambda: store.get_into(keys[0], first))
        assert gate.entered.wait(10)
        assert store.get_into(keys[1], second) and torch.equal(second, values[1])
        assert store.stats().tiers["slow"].hits == 1 and not held.finished.is_set()
        gate.open()
        assert held.outcome() and torch.equal(first, values[0])
        assert store.stats().tiers["fast"].hits == 1
        assert store.get_into(keys[1], second) and store.stats().tiers["fast"].hits == 2  # idle again: fastest first


def test_a_read_that_raises_ends_no_worker():
    """Tier a's one worker hits a read that raises (not a store failure: a bug, or a Store
    closing under a promotion) on chunk 0, which tier b also holds. Before the fix the
    exception ended the worker, and chunk 1, which only a holds, was never claimed:
    ``results`` waited for it forever."""
    outs = [torch.zeros(1) for _ in range(2)]
    raised = threading.Event()

    def read(tier, i, out):
        if tier == "a" and i == 0:
            raised.set()
            raise RuntimeError("not a tier error")
        out.fill_(i)
        return True

    job = FetchJob([frozenset({"a", "b"}), frozenset({"a"})], outs, read, stall_s=5)
    pool = ThreadPoolExecutor(2)
    workers = [pool.submit(job.work, "a")]
    assert raised.wait(10)  # a took chunk 0 first
    workers.append(pool.submit(job.work, "b"))
    got = []
    collect = threading.Thread(target=lambda: got.extend(job.results()), daemon=True)
    collect.start()
    collect.join(10)
    job.close()
    pool.shutdown(wait=True)
    assert not collect.is_alive(), "the fetch waited forever for a chunk only a dead worker could read"
    assert [int(t.item()) for t in got] == [0, 1]
    assert all(w.exception() is None for w in workers)


def test_a_stream_whose_workers_cannot_all_start_returns_only_once_no_read_writes_its_buffers(tmp_path):
    """The fetch workers were handed to the pools before the stream's ``finally`` that waits
    for them: when a later hand-off raised (a pool shut down by a Store closing meanwhile),
    ``get_many_into`` raised while an earlier worker still read into the caller's buffer."""
    from faults import FaultyTier, Gate
    from helpers import store_config

    keys = chunk_keys(list(range(FETCH_NS.chunk_tokens)), FETCH_NS)
    value = torch.randn(FETCH_NS.chunk_shape).half()
    tiers = [FaultyTier(DiskTier(tmp_path / name, 1 << 22, name=name)) for name in ("near", "far")]
    with Store(store_config(tmp_path, disk=None), extra_tiers=tiers) as store:
        store.put(keys[0], value, durable=True)
        assert store.drop(keys, "host") == 1
        gate = Gate()
        for tier in tiers:
            tier.gates["read"] = gate
        handed = []
        pools = store._reads._pools
        submits = {name: pools[name].submit for name in ("near", "far")}

        def submit_once(name):
            def submit(fn, *args):
                if handed:
                    raise RuntimeError("cannot schedule new futures after shutdown")
                handed.append(name)
                return submits[name](fn, *args)
            return submit

        for name in submits:
            pools[name].submit = submit_once(name)
        out = torch.full_like(value, 3.0)
        returned = threading.Event()
        late = []

        def open_later():
            assert gate.entered.wait(10)
            time.sleep(0.2)  # the call must still be waiting for the held read now
            late.append(returned.is_set())
            gate.open()

        opener = threading.Thread(target=open_later)
        opener.start()
        with pytest.raises(RuntimeError, match="shutdown"):
            store.get_many_into(keys, [out])
        returned.set()
        opener.join()
        for name, submit in submits.items():
            pools[name].submit = submit
        assert late == [False], "get_many_into raised while a read still wrote into its buffer"
