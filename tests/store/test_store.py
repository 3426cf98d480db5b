import random
import threading
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from faults import wait_until
from fsfaults import remount_read_only, tiny_tmpfs
from helpers import NS
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, WriteBehindConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.files import SUFFIX

PAGE = 4096


def config(tmp_path, host=64 * PAGE, disk=1 << 20, pending=16 * PAGE, **disk_kw) -> StoreConfig:
    return StoreConfig(
        host=HostTierConfig(capacity_bytes=host, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(path=str(tmp_path / "data"), capacity_bytes=disk, **disk_kw),
        write_behind=WriteBehindConfig(max_pending_bytes=pending),
    )


def chunks(n, ns=NS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 50_000, (n * ns.chunk_tokens,), generator=gen).tolist(), ns)
    dtype = getattr(torch, ns.dtype)
    values = [torch.randn(ns.chunk_shape, generator=gen).to(dtype) for _ in keys]
    return keys, values


def disk_files(tmp_path):
    return sorted(p for p in (tmp_path / "data").rglob("*" + SUFFIX))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_round_trip_is_bit_exact(tmp_path, dtype):
    ns = Namespace("m", 2, 2, 8, dtype=dtype, chunk_tokens=8)
    keys, values = chunks(6, ns)
    values[0].view(-1)[0] = float("nan")
    with Store(config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        assert store.lookup(keys) == 6
        got = store.get(keys)
        assert len(got) == 6
        for a, b in zip(got, values):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_lookup_is_longest_present_prefix(tmp_path):
    keys, values = chunks(5)
    with Store(config(tmp_path)) as store:
        for i in (0, 1, 3):
            store.put(keys[i], values[i])
        assert store.lookup(keys) == 2
        assert len(store.get(keys)) == 2
        assert store.lookup(keys[3:]) == 1
        assert store.lookup([]) == 0


@pytest.mark.parametrize("o_direct", [False, True])
def test_restart_keeps_disk_chunks(tmp_path, o_direct):
    keys, values = chunks(10)
    with Store(config(tmp_path, o_direct=o_direct)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
    with Store(config(tmp_path, o_direct=o_direct)) as store:
        assert store.lookup(keys) == 10
        got = store.get(keys)
        assert all(torch.equal(a, b) for a, b in zip(got, values))
        assert store.stats().tiers["disk"].hits == 10


def test_durable_put_is_on_disk_when_it_returns(tmp_path):
    keys, values = chunks(3)
    with Store(config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
            assert store.tiers[1].contains(k.id)
        assert len(disk_files(tmp_path)) == 3


@pytest.mark.parametrize("o_direct", [False, True])  # buffered reads hash as they land, O_DIRECT ones as copied out
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_flipped_byte_anywhere_in_a_file_is_never_returned(tmp_path_factory, o_direct, data):
    tmp_path = tmp_path_factory.mktemp("flip")
    keys, values = chunks(1)
    with Store(config(tmp_path, o_direct=o_direct)) as store:
        store.put(keys[0], values[0])
    (path,) = disk_files(tmp_path)
    raw = bytearray(path.read_bytes())
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    path.write_bytes(bytes(raw))
    with Store(config(tmp_path, o_direct=o_direct)) as store:
        out = torch.empty(NS.chunk_shape, dtype=torch.float16)
        assert store.get_into(keys[0], out) is False
        assert store.stats().tiers["disk"].corruptions == 1 and store.lookup(keys) == 0
        wait_until(lambda: not path.exists(), what="the corrupt file's delete (in the background)")


def test_truncated_file_is_a_miss_and_deleted(tmp_path):
    keys, values = chunks(2)
    with Store(config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
    path = disk_files(tmp_path)[0]
    path.write_bytes(path.read_bytes()[:300])
    with Store(config(tmp_path)) as store:
        served = 0
        for k, v in zip(keys, values):
            out = torch.empty_like(v)
            if store.get_into(k, out):
                assert torch.equal(out, v)
                served += 1
        assert served == 1 and store.stats().tiers["disk"].corruptions == 1
        wait_until(lambda: len(disk_files(tmp_path)) == 1, what="the truncated file's delete (in the background)")


def test_wrong_shape_dtype_namespace_are_clear_errors(tmp_path):
    keys, values = chunks(1)
    other_ns = Namespace("other-model", 2, 2, 8, chunk_tokens=8)
    with Store(config(tmp_path)) as store:
        with pytest.raises(ValueError, match="dtype"):
            store.put(keys[0], values[0].float())
        with pytest.raises(ValueError, match="shape"):
            store.put(keys[0], values[0][:1])
        with pytest.raises(TypeError):
            store.put(keys[0], values[0].numpy())
        store.put(keys[0], values[0])
        # The same tokens under another namespace are another key: a clean miss.
        other_key = chunk_keys([0] * 8, other_ns)[0]
        foreign = type(other_key)(other_ns, keys[0].prefix_hash)
        assert store.lookup([foreign]) == 0
        assert store.get_into(foreign, torch.empty(other_ns.chunk_shape, dtype=torch.float16)) is False
        with pytest.raises(ValueError):
            store.get_into(keys[0], torch.empty(3))


def test_promotion_on_read(tmp_path):
    keys, values = chunks(40)  # 40 KiB+ of blobs, host holds 16 pages
    with Store(config(tmp_path, host=16 * PAGE, pending=4 * PAGE)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        store.flush()
        assert not store.first.contains(keys[0].id) and store.tiers[1].contains(keys[0].id)
        out = torch.empty_like(values[0])
        assert store.get_into(keys[0], out) and torch.equal(out, values[0])
        assert store.first.contains(keys[0].id)
        stats = store.stats()
        assert stats.tiers["disk"].hits == 1 and stats.tiers["host"].evictions > 0
        assert store.get_into(keys[0], out)
        assert store.stats().tiers["host"].hits == 1


def test_write_behind_backpressure_bounds_pending_bytes(tmp_path):
    keys, values = chunks(64)
    limit = 8 * PAGE
    peak = 0
    stop = threading.Event()
    with Store(config(tmp_path, host=32 * PAGE, pending=limit, fsync=True)) as store:

        def watch():
            nonlocal peak
            while not stop.is_set():
                peak = max(peak, store.stats().write_behind_pending_bytes)

        watcher = threading.Thread(target=watch)
        watcher.start()
        for k, v in zip(keys, values):
            store.put(k, v)
        stop.set()
        watcher.join()
        assert 0 < peak <= limit
        store.flush()
        assert store.stats().write_behind_pending_bytes == 0
        assert store.first.used_bytes <= store.first.capacity_bytes


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from("pgd"), st.integers(0, 29)), min_size=1, max_size=120))
def test_storm_never_exceeds_capacity_and_never_returns_wrong_data(tmp_path_factory, ops):
    tmp_path = tmp_path_factory.mktemp("storm")
    keys, values = chunks(30)
    cfg = config(tmp_path, host=12 * PAGE, disk=20 * PAGE, pending=4 * PAGE)
    with Store(cfg) as store:
        out = torch.empty_like(values[0])
        for op, i in ops:
            if op == "p":
                store.put(keys[i], values[i])
            elif op == "g":
                if store.get_into(keys[i], out):
                    assert torch.equal(out, values[i])
            else:
                store.delete([keys[i]])
                assert store.lookup([keys[i]]) == 0
            for tier in (store.first, store.tiers[1]):
                assert tier.used_bytes <= tier.capacity_bytes
        store.flush()
        on_disk = sum(p.stat().st_size for p in disk_files(tmp_path))
        assert on_disk <= cfg.disk.capacity_bytes


def test_concurrent_readers_and_writers(tmp_path):
    keys, values = chunks(60)
    errors = []
    with Store(config(tmp_path, host=24 * PAGE, pending=8 * PAGE)) as store:

        def writer(offset):
            for i in range(offset, 60, 3):
                store.put(keys[i], values[i])

        def reader(seed):
            rng = random.Random(seed)
            out = torch.empty_like(values[0])
            for _ in range(200):
                i = rng.randrange(60)
                if store.get_into(keys[i], out) and not torch.equal(out, values[i]):
                    errors.append(i)

        threads = [threading.Thread(target=writer, args=(o,)) for o in range(3)]
        threads += [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        store.flush()
        assert not errors
        assert store.lookup(keys) == 60  # everything fits on disk
        assert all(torch.equal(a, b) for a, b in zip(store.get(keys), values))


def test_delete_removes_every_copy(tmp_path):
    keys, values = chunks(3)
    with Store(config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert store.delete(keys[:2]) == 2
        assert store.delete(keys[:2]) == 0
        assert store.lookup(keys) == 0 and store.lookup(keys[2:]) == 1
        assert len(disk_files(tmp_path)) == 1


def test_full_disk_keeps_serving_from_host(tmp_path):
    with tiny_tmpfs(tmp_path / "data", 8 * PAGE):
        keys, values = chunks(16)
        cfg = config(tmp_path, disk=1 << 30)  # configured larger than the device
        with Store(cfg) as store:
            for k, v in zip(keys, values):
                store.put(k, v)
            store.flush()
            stats = store.stats()
            assert stats.tiers["disk"].errors > 0 and stats.write_behind_dropped > 0
            assert all(torch.equal(a, b) for a, b in zip(store.get(keys), values))


def test_read_only_disk_durable_put_fails_clearly_and_host_still_serves(tmp_path):
    with tiny_tmpfs(tmp_path / "data", 1 << 20) as mnt:
        keys, values = chunks(2)
        with Store(config(tmp_path)) as store:
            store.put(keys[0], values[0], durable=True)
            remount_read_only(mnt)
            with pytest.raises(Exception, match="Read-only|read-only"):
                store.put(keys[1], values[1], durable=True)
            got = store.get(keys)
            assert len(got) == 2 and torch.equal(got[1], values[1])


def test_close_flushes_write_behind(tmp_path):
    keys, values = chunks(20)
    store = Store(config(tmp_path))
    for k, v in zip(keys, values):
        store.put(k, v)
    store.close()
    assert len(disk_files(tmp_path)) == 20
    with pytest.raises(Exception, match="closed"):
        store.put(keys[0], values[0])


def test_disk_disabled_store_works_in_ram(tmp_path):
    cfg = config(tmp_path)
    cfg.disk.enabled = False
    keys, values = chunks(4)
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert all(torch.equal(a, b) for a, b in zip(store.get(keys), values))
        assert "disk" not in store.stats().tiers
    assert not (tmp_path / "data").exists()


def test_a_second_store_on_the_same_host_pool_file_is_refused_and_the_first_keeps_its_chunks(tmp_path):
    """Two in-process stores given one ``host.shm_path``: the second opened the pool file with
    O_TRUNC and no lock, so the first store's acknowledged chunks read back as zeros (and both
    stores handed out the same pages). The second is now refused with a clear error."""
    from tiers.base import TierUnavailable

    cfg = config(tmp_path)
    cfg.disk.enabled = False
    cfg.host.shm_path = str(tmp_path / "pool")
    keys, values = chunks(2)
    with Store(cfg) as first:
        for k, v in zip(keys, values):
            first.put(k, v)
        with pytest.raises(TierUnavailable, match="another live store"):
            Store(cfg)
        got = first.get(keys)
        assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, values))


def test_pinned_chunks_are_not_evicted_until_unpinned_or_expired(tmp_path):
    cfg = config(tmp_path, host=12 * PAGE, pending=2 * PAGE)
    cfg.disk.enabled = False
    keys, values = chunks(20)
    with Store(cfg) as store:
        store.put(keys[0], values[0])
        assert store.pin(keys[:1] + keys[5:6], ttl_s=60) == 1
        for k, v in zip(keys[1:], values[1:]):
            store.put(k, v)
        assert store.contains(keys[0]) and store.stats().pinned == 1
        assert store.unpin(keys[:1]) == 1
        for k, v in zip(keys[1:], values[1:]):
            store.put(k, v)
        assert not store.contains(keys[0])
        store.put(keys[0], values[0])
        store.pin(keys[:1], ttl_s=0.05)
        wait_until(lambda: store.stats().pinned == 0, what="the pin to expire")
        for k, v in zip(keys[1:], values[1:]):
            store.put(k, v)
        assert not store.contains(keys[0])
        with pytest.raises(ValueError):
            store.pin(keys, ttl_s=0)


def test_host_full_of_pinned_chunks_is_a_clear_error(tmp_path):
    cfg = config(tmp_path, host=4 * PAGE)
    cfg.disk.enabled = False
    keys, values = chunks(8)
    with Store(cfg) as store:
        for k, v in zip(keys[:4], values[:4]):
            store.put(k, v)
        store.pin(keys[:4], ttl_s=60)
        with pytest.raises(Exception, match="pinned"):
            store.put(keys[5], values[5])
        assert len(store.get(keys[:4])) == 4


def test_prefetch_promotes_to_host_and_get_blob_returns_verified_bytes(tmp_path):
    from kvstore.blob import verify_blob

    keys, values = chunks(30)
    with Store(config(tmp_path, host=16 * PAGE, pending=4 * PAGE)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        store.flush()
        cold = [k for k in keys if not store.first.contains(k.id)]
        assert cold
        for fut in store.prefetch(cold[:3]):
            fut.result()
        assert all(store.first.contains(k.id) for k in cold[:3])
        header, payload = verify_blob(store.get_blob(keys[0]), keys[0])
        assert bytes(payload) == values[0].view(torch.uint8).numpy().tobytes()
        assert store.get_blob(chunks(1, seed=99)[0][0]) is None


def test_replicas_on_extra_tiers_and_fallback_when_one_is_corrupt(tmp_path):
    from tiers.disk import DiskTier

    second = DiskTier(tmp_path / "pfs", 1 << 20, name="pfs")
    keys, values = chunks(4)
    with Store(config(tmp_path), extra_tiers=[second]) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert all(store.tiers[1].contains(k.id) and second.contains(k.id) for k in keys)
        assert store.drop(keys[:1], "host") == 1
        path = store.tiers[1].path_of(keys[0].id)
        raw = bytearray(path.read_bytes())
        raw[200] ^= 1
        path.write_bytes(bytes(raw))
        out = torch.empty_like(values[0])
        assert store.get_into(keys[0], out) and torch.equal(out, values[0])
        stats = store.stats()
        assert stats.tiers["disk"].corruptions == 1 and stats.tiers["pfs"].hits == 1
        assert store.delete(keys) == 4
        assert len(second) == 0 and len(store.tiers[1]) == 0


def test_restart_recovers_from_every_persistent_tier(tmp_path):
    from tiers.disk import DiskTier

    keys, values = chunks(3)
    with Store(config(tmp_path), extra_tiers=[DiskTier(tmp_path / "pfs", 1 << 20, name="pfs")]) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
    (tmp_path / "data").rename(tmp_path / "gone")
    with Store(config(tmp_path), extra_tiers=[DiskTier(tmp_path / "pfs", 1 << 20, name="pfs")]) as store:
        assert store.lookup(keys) == 3
        assert all(torch.equal(a, b) for a, b in zip(store.get(keys), values))


@pytest.mark.parametrize("with_parents", [False, True])
@pytest.mark.parametrize("disk", [False, True])
def test_default_policy_keeps_the_newest_chunks(tmp_path, with_parents, disk):
    """The store's default policy (shadow-vote) keeps recent chunks whether or not callers
    report parents, and whether or not chunks leave and re-enter it for their disk copies."""
    keys, values = chunks(40)
    cfg = config(tmp_path, host=16 * PAGE, pending=4 * PAGE)
    cfg.disk.enabled = disk
    with Store(cfg) as store:
        assert type(store.index.policies["host"]).name == "shadow-vote"
        for i, (k, v) in enumerate(zip(keys, values)):
            store.put(k, v, parent=keys[i - 1] if with_parents and i else None)
        store.flush()
        resident = [store.first.contains(k.id) for k in keys]
        assert resident[-4:] == [True] * 4, resident
        assert not all(resident[:8]), resident


def _gathered(store, runs) -> bytes:
    return b"".join(bytes(v) for v in store.first.views(runs))


def test_lend_names_raw_host_bytes_and_keeps_them_until_released(tmp_path):
    keys, values = chunks(3, seed=21)
    with Store(config(tmp_path)) as store:
        store.put(keys[0], values[0])
        store.put(keys[1], values[1], codec="int8")
        hits = store.stats().tiers["host"].hits
        lent = store.lend(keys[0])
        assert _gathered(store, lent.runs) == values[0].numpy().tobytes()
        store.delete(keys[:1])
        for k, v in zip(*chunks(80, seed=22)):  # churn the pool: pinned pages are not reused
            store.put(k, v)
        assert _gathered(store, lent.runs) == values[0].numpy().tobytes()
        lent.release()
        lent.release()  # twice: no harm
        assert store.stats().tiers["host"].hits == hits + 1
        assert store.lend(keys[1]) is None  # encoded: only get_into can decode it
        assert store.lend(keys[2]) is None  # absent


def test_lend_drops_a_corrupt_header():
    keys, values = chunks(1, seed=23)
    ram_only = StoreConfig(host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False),
                           disk=DiskTierConfig(enabled=False))
    with Store(ram_only) as store:
        store.put(keys[0], values[0])
        with store.first.pinned(keys[0].id) as views:
            views[0][10] ^= 0xFF  # inside the header: its checksum no longer matches
        assert store.lend(keys[0]) is None
        assert store.stats().tiers["host"].corruptions == 1 and store.lookup(keys) == 0


@pytest.mark.parametrize("stop", ["encoded", "absent", "corrupt"])
def test_lend_many_lends_the_leading_raw_chunks_and_holds_nothing_past_the_first_it_cannot(stop):
    keys, values = chunks(5, seed=24)
    ram_only = StoreConfig(host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False),
                           disk=DiskTierConfig(enabled=False))
    with Store(ram_only) as store:
        for i, (k, v) in enumerate(zip(keys, values)):
            store.put(k, v, codec="int8" if stop == "encoded" and i == 2 else None)
        if stop == "absent":
            store.delete(keys[2:3])
        if stop == "corrupt":
            with store.first.pinned(keys[2].id) as views:
                views[0][10] ^= 0xFF
        hits = store.stats().tiers["host"].hits
        lent = store.lend_many(keys)
        assert [_gathered(store, one.runs) for one in lent] == [v.numpy().tobytes() for v in values[:2]]
        assert store.stats().tiers["host"].hits == hits + 2
        assert store.stats().tiers["host"].corruptions == (stop == "corrupt")
        store.delete(keys)
        for one in lent:
            one.release()
        assert store.stats().tiers["host"].used_bytes == 0, "a pin is still held"


@pytest.mark.parametrize("verify", [False, True])
def test_a_store_says_whether_its_lends_hash_payloads(verify):
    """The daemon pins on its event loop only where a lend touches nothing but memory."""
    ram_only = StoreConfig(host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False,
                                               verify_payload=verify),
                           disk=DiskTierConfig(enabled=False))
    with Store(ram_only) as store:
        assert store.lend_hashes_payloads is verify


@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.integers(0, 400))
def test_split_runs_cuts_byte_ranges_at_any_point(lengths, n):
    from kvstore.store.read_path import split_runs

    runs, offset = [], 0
    for length in lengths:
        runs.append((offset, length))
        offset += length + 7  # gaps between runs
    flat = [o + i for o, length in runs for i in range(length)]
    head, tail = split_runs(runs, n)
    assert [o + i for o, length in head for i in range(length)] == flat[:n]
    assert [o + i for o, length in tail for i in range(length)] == flat[n:]
    assert all(length > 0 for _, length in head + tail)


def test_copy_workers_racing_for_disk_room_never_drop_a_copy(tmp_path, monkeypatch):
    """Copy workers each make room for their chunk, then write outside the lock: one used to
    find the room taken by another (TierFull) and drop its copy. It must evict again instead.
    The disk's writes start 2 ms late here, which widens the window the race needs."""
    from tiers.disk import DiskTier

    write = DiskTier.write

    def late_write(self, key, parts):
        time.sleep(0.002)
        return write(self, key, parts)

    monkeypatch.setattr(DiskTier, "write", late_write)
    cfg = config(tmp_path, host=256 * PAGE, disk=12 * PAGE, pending=64 * PAGE)
    cfg.write_behind.workers = 4
    keys, values = chunks(200, seed=41)
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        store.flush()
        stats = store.stats()
        assert stats.write_behind_dropped == 0 and stats.tiers["disk"].errors == 0


def test_a_put_reaches_the_first_tiers_policy_as_one_access_in_put_order(tmp_path):
    """The first tier's policy sees each put when it happens; the chunk then leaves the
    policy until its copies are done (it must not be evicted before) and comes back, which
    shadow-vote does not count as another access."""
    keys, values = chunks(3)
    with Store(config(tmp_path)) as store:
        calls = []
        policy = store.index.policies["host"]
        for name in ("on_insert", "on_remove", "on_hit"):
            method = getattr(policy, name)
            setattr(policy, name, lambda *a, _name=name, _method=method, **kw: (calls.append((_name, a[0])), _method(*a, **kw)))
        for k, v in zip(keys, values):
            store.put(k, v)
        store.flush()
        firsts = [key for name, key in calls if name == "on_insert"]
        assert [k.id for k in keys] == list(dict.fromkeys(firsts))  # first insertions in put order
        for k in keys:
            assert [name for name, key in calls if key == k.id] == ["on_insert", "on_remove", "on_insert"]
        accesses = policy._accesses
        store.put(keys[0], values[0])  # already there: an access
        assert calls[-1] == ("on_hit", keys[0].id) and policy._accesses == accesses + 1


def test_a_chunk_pinned_and_unpinned_keeps_its_policy_standing(tmp_path):
    """Pinning takes a chunk out of its tiers' policies and unpinning hands it back: with ARC,
    a chunk hit once (T2) must come back to T2, not start over in T1 as a new chunk."""
    cfg = config(tmp_path)
    cfg.eviction_policy = "arc"
    keys, values = chunks(2)
    with Store(cfg) as store:
        store.put(keys[0], values[0])
        store.flush()  # copies done: back in the host policy, not counted as an access
        arcs = store.index.policies.values()
        assert all(keys[0].id in arc._t1 for arc in arcs)
        assert len(store.get(keys[:1])) == 1
        assert all(keys[0].id in arc._t2 for arc in arcs)
        assert store.pin(keys[:1], ttl_s=60) == 1
        assert all(keys[0].id not in arc for arc in arcs)
        assert store.unpin(keys[:1]) == 1
        assert all(keys[0].id in arc._t2 for arc in arcs)


def test_hits_on_a_pinned_chunk_reach_its_policies(tmp_path):
    """The connector pins the chunks it is about to load: their loads (and re-puts) are hits
    the policies must count, though the chunks are out of them while pinned."""
    cfg = config(tmp_path)
    cfg.eviction_policy = "arc"
    keys, values = chunks(2)
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        store.flush()
        store.pin(keys, ttl_s=60)
        assert len(store.get(keys[:1])) == 1  # a load while pinned
        store.put(keys[1], values[1])  # a put of a present chunk while pinned
        store.unpin(keys)
        for name, arc in store.index.policies.items():
            assert keys[0].id in arc._t2, name
        assert keys[1].id in store.index.policies["host"]._t2


@pytest.mark.parametrize("pinned", [False, True])
def test_a_chunk_deleted_and_put_again_starts_over_in_its_policies(tmp_path, pinned):
    """Deleting is no hold: the policies forget the chunk, and putting it again is new. Also
    when it is deleted while pinned, out of its policies (a regression: they were never told
    it left for good and handed its old standing back)."""
    cfg = config(tmp_path)
    cfg.eviction_policy = "arc"
    keys, values = chunks(1)
    with Store(cfg) as store:
        store.put(keys[0], values[0])
        store.flush()
        assert len(store.get(keys)) == 1
        host = store.index.policies["host"]
        assert keys[0].id in host._t2
        if pinned:
            assert store.pin(keys, ttl_s=60) == 1
        assert store.delete(keys) == 1
        store.put(keys[0], values[0])
        store.flush()
        assert keys[0].id in host._t1


def test_a_closed_store_refuses_every_call(tmp_path):
    keys, values = chunks(1)
    store = Store(config(tmp_path))
    store.put(keys[0], values[0])
    store.close()
    for call in (lambda: store.lookup(keys), lambda: store.pin(keys, 1.0), lambda: store.unpin(keys),
                 lambda: store.get(keys), lambda: store.get_into(keys[0], torch.empty_like(values[0])),
                 lambda: store.get_blob(keys[0]), lambda: store.prefetch(keys), lambda: store.delete(keys),
                 lambda: store.put(keys[0], values[0])):
        with pytest.raises(Exception, match="closed"):
            call()


def test_a_new_chunk_is_written_once_and_its_blob_verifies_on_every_tier(tmp_path):
    """A put of a new chunk seals its header from the checksum the host tier computed while
    copying the payload in; the blob is the same as the two-pass one, and a re-put of the
    same chunk is still recognised (no new version)."""
    from kvstore.blob import encode_header, verify_blob
    from kvstore.codecs.raw import tensor_bytes

    (key,), (kv,) = chunks(1)
    with Store(config(tmp_path)) as store:
        store.put(key, kv)
        store.flush()
        version = store.index.get(key.id).version
        expected = encode_header(key, 0, kv.dtype, kv.shape, tensor_bytes(kv))
        for name in ("host", "disk"):
            blob = store.tier(name).read(key.id)
            verify_blob(blob, key)
            assert bytes(blob[:128]) == expected
        store.put(key, kv)
        assert store.index.get(key.id).version == version
        out = torch.empty_like(kv)
        assert store.get_into(key, out) and torch.equal(out, kv)


def test_a_read_into_an_inference_tensor_decodes_it_and_drops_nothing(tmp_path):
    """A buffer made under torch.inference_mode can be written in place only in inference
    mode, and reads decode on the Store's threads: the decode raised there, and the read
    took that for a corrupt payload and dropped the chunk's (maybe durable) copy."""
    keys, values = chunks(2, seed=31)
    with Store(config(tmp_path)) as store:
        for k, v, codec in zip(keys, values, ("int8", "lz4")):
            store.put(k, v, codec=codec, durable=True)
        with torch.inference_mode():
            outs = [torch.empty_like(v) for v in values]
        assert store.get_many_into(keys, outs) == 2
        assert store.get_into(keys[0], outs[0])
        assert store.lookup(keys) == 2 and store.stats().tiers["host"].corruptions == 0
        assert torch.equal(outs[1], values[1])
