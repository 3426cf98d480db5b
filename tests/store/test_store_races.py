"""Regression tests for the Store's races and faults found by the review
(../shared/research/defects-review.md, numbers in the names) and by a soak of mixed traffic.

Each lines its race up with gates (tests/faults.py) instead of sleeping for it, and each
fails on the code the review read (commit 733db83). Where a test must show that a call does
*not* return early, it gives the call a short bounded wait first: on the fixed code that
wait always runs out, so the test never depends on timing to pass.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

import kvstore.store.write_behind
from faults import Call, FaultyTier, Gate, ManualClock, key_lock_waiters, wait_until
from helpers import PAGE, chunks, same, store_config
from kvstore.blob import encode_header
from kvstore.codecs import get_codec
from kvstore.store import Store
from tiers.base import TierError, TierFull, TierUnavailable
from tiers.host import HostTier
from tiers.disk import DiskTier


def faulty_store(tmp_path, names=("disk",), workers=1, stall_s=10.0, delay_s=None,
                 **kw) -> tuple[Store, list[FaultyTier]]:
    """A Store whose replica tiers are real disk tiers behind FaultyTier wrappers; ``delay_s``
    0 where the test's clock does not move by itself."""
    cfg = store_config(tmp_path, disk=None, **kw)
    cfg.write_behind.workers = workers
    cfg.write_behind.stall_s = stall_s
    if delay_s is not None:
        cfg.write_behind.delay_s = delay_s
    tiers = [FaultyTier(DiskTier(tmp_path / name, 1 << 20, name=name)) for name in names]
    return Store(cfg, extra_tiers=tiers), tiers


def blob_size(value: torch.Tensor, codec: str) -> int:
    return 128 + len(get_codec(codec).encode(value))


def loads(store: Store, key, value) -> bool:
    out = torch.empty_like(value)
    return store.get_into(key, out) and same(out, value)


# -- #2: a durable put acknowledged while its copy was skipped -----------------------------------


def test_2_durable_reput_with_another_codec_while_the_first_copy_runs_reaches_disk(tmp_path):
    store, (disk,) = faulty_store(tmp_path)
    keys, values = chunks(1)
    with store:
        gate = disk.gates["write"] = Gate(keys[0].id, times=1)
        store.put(keys[0], values[0])
        assert gate.entered.wait(10)  # the raw copy is being written
        reput = Call(lambda: store.put(keys[0], values[0], codec="lz4", durable=True))
        wait_until(lambda: store.first.size_of(keys[0].id) == blob_size(values[0], "lz4"), what="the re-put in host RAM")
        gate.open()
        reput.outcome()
        assert store.drop(keys, "host") == 1
        assert loads(store, keys[0], values[0])  # from the disk copy, which is the lz4 one
        assert disk.size_of(keys[0].id) == blob_size(values[0], "lz4")


def test_2_a_host_copy_dropped_while_its_copy_is_queued_is_still_copied(tmp_path):
    store, (disk,) = faulty_store(tmp_path)
    keys, values = chunks(2)
    with store:
        gate = disk.gates["write"] = Gate(keys[0].id, times=1)
        store.put(keys[0], values[0])
        assert gate.entered.wait(10)  # the one copy worker is busy: keys[1]'s copy waits
        put = Call(lambda: store.put(keys[1], values[1], durable=True))
        wait_until(lambda: store.first.contains(keys[1].id), what="keys[1] in host RAM")
        drop = Call(lambda: store.drop(keys[1:], "host"))
        drop.finished.wait(0.5)  # the old code dropped at once; the fixed one waits for the copy
        gate.open()
        assert drop.outcome() == 1
        put.outcome()
        assert store.lookup(keys) == 2 and loads(store, keys[1], values[1])


def test_2_a_host_copy_found_corrupt_while_its_copy_is_queued_fails_the_durable_put(tmp_path):
    store, (disk,) = faulty_store(tmp_path)
    keys, values = chunks(2)
    with store:
        gate = disk.gates["write"] = Gate(keys[0].id, times=1)
        store.put(keys[0], values[0])
        assert gate.entered.wait(10)
        put = Call(lambda: store.put(keys[1], values[1], durable=True))
        wait_until(lambda: store.first.contains(keys[1].id), what="keys[1] in host RAM")
        with store.first.pinned(keys[1].id) as views:
            views[0][10] ^= 0xFF  # the header no longer verifies
        assert not store.get_into(keys[1], torch.empty_like(values[1]))
        gate.open()
        with pytest.raises(TierError, match="copy is gone"):
            put.outcome()
        assert store.lookup(keys[1:]) == 0


def test_2_a_promotion_of_the_old_encoding_racing_a_durable_reput_loses_nothing(tmp_path, monkeypatch):
    store, (disk,) = faulty_store(tmp_path)
    (key, blocker), (value, other) = chunks(2)
    raw = blob_size(value, "raw")
    promotion = Gate(key.id, times=1)
    write = HostTier.write

    def gated_write(self, k, parts):
        if sum(memoryview(p).nbytes for p in parts) == raw:
            promotion.pass_through(k)
        return write(self, k, parts)

    with store:
        store.put(key, value)
        store.flush()
        store.drop([key], "host")  # on disk only, raw
        copy = disk.gates["write"] = Gate(blocker.id, times=1)
        store.put(blocker, other)
        assert copy.entered.wait(10)  # the copy worker is busy: key's next copy waits
        monkeypatch.setattr(HostTier, "write", gated_write)
        read = Call(lambda: loads(store, key, value))
        assert promotion.entered.wait(10)  # the read's promotion of the raw copy is under way
        reput = Call(lambda: store.put(key, value, codec="lz4", durable=True))
        wait_until(lambda: store.first.size_of(key.id) == blob_size(value, "lz4")
                   or key_lock_waiters(store, "host", key.id) >= 2, what="the re-put to start")
        promotion.open()
        assert read.outcome()
        copy.open()
        reput.outcome()
        store.drop([key], "host")
        assert loads(store, key, value)


# -- #3: a durable put acknowledged after its copy failed -------------------------------------------


def test_3_a_concurrent_put_of_the_same_chunk_cannot_clear_a_durable_puts_error(tmp_path, monkeypatch):
    store, (disk,) = faulty_store(tmp_path)
    keys, values = chunks(1)
    putter: dict = {}

    class WakeHook(threading.Event):
        """When the durable putter wakes, another put of the chunk runs before it looks."""

        def wait(self, timeout=None):
            woke = super().wait(timeout)
            if threading.current_thread() is putter.get("thread") and putter.pop("hook", None):
                store.put(keys[0], values[0])
            return woke

    with store:
        disk.failures["write"] = 1
        monkeypatch.setattr(threading, "Event", WakeHook)
        putter["hook"] = True
        put = putter["thread"] = Call(lambda: store.put(keys[0], values[0], durable=True), start=False)
        put.start()
        with pytest.raises(TierUnavailable, match="injected write failure"):
            put.outcome()


# -- #5: reads outliving get_many_into and stream ---------------------------------------------------


def _on_disk_only(store, keys, values):
    for k, v in zip(keys, values):
        store.put(k, v, durable=True)
    store.drop(keys, "host")


@pytest.mark.parametrize("how", ["get_many_into", "stream"])
def test_5_a_read_call_returns_only_when_nothing_writes_the_callers_buffers(tmp_path, how):
    store, (disk,) = faulty_store(tmp_path, promote_on_read=False)
    keys, values = chunks(2)
    with store:
        _on_disk_only(store, keys, values)
        if how == "get_many_into":
            path = disk.path_of(keys[0].id)  # keys[0]'s only replica is bad: the call misses at 0
            raw = bytearray(path.read_bytes())
            raw[300] ^= 1
            path.write_bytes(bytes(raw))
        first, gate = Gate(keys[0].id, times=1), Gate(keys[1].id, times=1)
        disk.gates["read"] = [first, gate]  # both reads under way before keys[0]'s ends
        outs = [torch.empty_like(v) for v in values]
        if how == "get_many_into":
            call = Call(lambda: store.get_many_into(keys, outs))
        else:
            call = Call(lambda: next(iter(store.stream(keys, outs=outs))))  # takes one chunk, closes the stream
        assert gate.entered.wait(10) and first.entered.wait(10)
        first.open()
        wait_until(lambda: store.stats().tiers["disk"].corruptions + store.stats().tiers["disk"].hits == 1,
                   what="keys[0] read")
        early = call.finished.wait(0.5)  # the old code returned here while keys[1]'s read was writing outs[1]
        gate.open()
        call.outcome()
        assert not early
        outs[1].fill_(7.0)  # the caller reuses its buffer
        wait_until(lambda: store.stats().tiers["disk"].hits + store.stats().tiers["disk"].corruptions == 2,
                   what="keys[1] read")
        assert bool((outs[1] == 7.0).all())
        assert store.stats().tiers["disk"].corruptions == (1 if how == "get_many_into" else 0)
        assert loads(store, keys[1], values[1])  # its good replica was not blamed


# -- #6: an encoded payload of exactly the raw size -------------------------------------------------


def _raw_sized_lz4_chunk(ns) -> torch.Tensor:
    """An fp16 chunk whose lz4 payload is exactly as long as its raw bytes: plane 0
    compresses by the 12 bytes the planes' headers take, plane 1 not at all."""
    n = int(np.prod(ns.chunk_shape))
    rng = np.random.default_rng(0)
    low, high = rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, n, dtype=np.uint8)
    low[:19] = 0
    tensor = torch.from_numpy(np.stack([low, high], 1).reshape(-1).view(np.float16).copy()).view(ns.chunk_shape)
    assert len(get_codec("lz4").encode(tensor)) == 2 * n
    return tensor


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_6_an_encoded_payload_of_exactly_the_raw_size_is_decoded_not_returned_as_is(tmp_path, tier):
    keys, _ = chunks(1)
    value = _raw_sized_lz4_chunk(keys[0].namespace)
    with Store(store_config(tmp_path)) as store:
        store.put(keys[0], value, codec="lz4", durable=True)
        if tier == "disk":
            store.drop(keys, "host")
        assert loads(store, keys[0], value)
        assert same(store.get(keys)[0], value)


def test_6_a_payload_that_does_not_decode_is_a_corrupt_replica_dropped_and_counted(tmp_path):
    keys, values = chunks(1)
    key = keys[0]
    garbage = np.random.default_rng(1).integers(0, 256, 300, dtype=np.uint8).tobytes()
    header = encode_header(key, get_codec("lz4").codec_id, values[0].dtype, values[0].shape, garbage)
    with Store(store_config(tmp_path, disk=None)) as store:
        store.put_blob(key.id, [header, garbage])  # verified bytes, but not an lz4 payload
        assert not store.get_into(key, torch.empty_like(values[0]))
        assert store.stats().tiers["host"].corruptions == 1 and store.lookup(keys) == 0


# -- #9: a restart with one chunk at different sizes in two persistent tiers -------------------------


def test_9_a_chunk_held_at_different_sizes_by_two_tiers_is_indexed_in_both_after_restart(tmp_path):
    keys, values = chunks(1)
    key, value = keys[0], values[0]

    def store():
        return Store(store_config(tmp_path), extra_tiers=[DiskTier(tmp_path / "pfs", 1 << 20, name="pfs")])

    with store() as s:
        s.put(key, value, durable=True)
    payload = get_codec("lz4").encode(value)
    second = DiskTier(tmp_path / "pfs", 1 << 20, name="pfs")
    second.write(key.id, [encode_header(key, get_codec("lz4").codec_id, value.dtype, value.shape, payload), payload])
    second.close()  # the second tier now holds another encoding (as placement would have left it)
    with store() as s:
        # both copies are indexed (so both can be evicted and deleted), but only the one found
        # first is current: the other may as well be an older put's (test_store_restart_tiers.py)
        assert s.replicas(keys) == [frozenset({"disk"})]
        assert s.index.get(key.id).replicas.keys() == {"disk", "pfs"}
        s.drop(keys, "disk")
        assert s.lookup(keys) == 0  # the lz4 copy is never served for the raw put
        assert s.delete(keys) == 0  # nothing readable was there, but the stale copy goes too
        assert len(s.tier("pfs")) == 0 and len(s.tier("disk")) == 0


# -- found by a soak: re-putting a chunk held only below host RAM ----------------------------------


def test_a_reput_with_another_codec_of_a_chunk_only_on_disk_is_tracked_and_deletable(tmp_path):
    keys, values = chunks(11)
    with Store(store_config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        store.flush()
        store.drop(keys, "host")
        for k, v in zip(keys, values):
            store.put(k, v, codec="lz4")
        assert store.lookup(keys) == 11 and all(loads(store, k, v) for k, v in zip(keys, values))
        assert store.delete(keys) == 11
        assert len(store.first) == 0 and store.first.used_bytes == 0


# -- #10: pins -------------------------------------------------------------------------------------------


def test_10_the_pin_heap_stays_bounded_and_no_pin_outlives_max_pin_ttl(tmp_path):
    keys, values = chunks(8)
    with Store(store_config(tmp_path, disk=None, max_pin_ttl_s=0.2)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        for _ in range(5000):
            store.pin(keys, ttl_s=0.01)
        assert store.index.pin_heap_size <= len(keys)
        store.unpin(keys)
        assert store.pin(keys, ttl_s=1e9) == 8 and store.stats().pinned == 8
        wait_until(lambda: store.stats().pinned == 0, what="pins capped at max_pin_ttl_s to end")
        assert store.index.pin_heap_size == 0


class SteppingClock:
    """``time`` for the store's modules, whose monotonic clock moves one second a reading:
    any two readings in one snapshot differ, so a pin can end between them."""

    def __init__(self):
        self.now = time.monotonic()

    def monotonic(self) -> float:
        self.now += 1.0
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.mark.parametrize("ttl_s", [1.0, 2.0, 3.0, 4.0, 5.0])
def test_10_stats_counts_pins_and_expires_the_heap_at_one_instant(tmp_path, monkeypatch, ttl_s):
    """A snapshot read the clock twice (expire the heap, then count pins): a pin that ran
    out between the readings was counted gone while its heap item stayed due (CI, once)."""
    import kvstore.store.index
    import kvstore.store.facade

    keys, values = chunks(1)
    with Store(store_config(tmp_path, disk=None, max_pin_ttl_s=60.0)) as store:
        store.put(keys[0], values[0])
        clock = SteppingClock()
        monkeypatch.setattr(kvstore.store.facade, "time", clock)
        monkeypatch.setattr(kvstore.store.index, "time", clock)
        assert store.pin(keys, ttl_s=ttl_s) == 1
        pinned = store.stats().pinned
        heap = store.index.pin_heap_size
        store.unpin(keys)
        monkeypatch.undo()
        assert (pinned, heap) in {(1, 1), (0, 0)}


# -- #12 and #13: a hung tier slows only its own work ---------------------------------------------------


def test_12_a_hung_delete_on_one_tier_blocks_no_other_call(tmp_path):
    store, (disk,) = faulty_store(tmp_path)
    keys, values = chunks(4)
    with store:
        for k, v in zip(keys[:3], values[:3]):
            store.put(k, v, durable=True)
        gate = disk.gates["delete"] = Gate(keys[0].id, times=1)
        delete = Call(lambda: store.delete(keys[:1]))
        assert gate.entered.wait(10)  # the disk's delete hangs (a hung mount)

        def others():
            store.put(keys[3], values[3])
            assert loads(store, keys[1], values[1])
            assert store.lookup(keys[1:]) == 3 and store.stats().chunks == 3
            store.pin(keys[1:2], ttl_s=5)
            store.unpin(keys[1:2])

        Call(others).outcome(timeout_s=10)
        gate.open()
        assert delete.outcome() == 1


def test_13_a_stalled_replica_tier_does_not_stop_puts_or_the_other_tiers_copies(tmp_path, monkeypatch):
    """The pfs hangs: once its queue is full and it is stalled, puts skip it, and every copy
    still reaches the disk. Write-behind's clock moves only when the test moves it, so the
    disk can be judged stalled only by its own copies' lack of progress, never by the
    machine's load (in CI a busy disk was taken for a stalled one in 2 runs of 6)."""
    clock = ManualClock()
    monkeypatch.setattr(kvstore.store.write_behind, "time", clock)
    store, (disk, pfs) = faulty_store(tmp_path, names=("disk", "pfs"), workers=2, stall_s=5.0, delay_s=0,
                                      host=256 * PAGE, pending=8 * PAGE)
    keys, values = chunks(48)
    size, queued = blob_size(values[0], "raw"), 8 * PAGE // blob_size(values[0], "raw")
    with store:
        hang = pfs.gates["write"] = Gate()
        try:  # a failed check must not leave the store's close waiting on the hung tier
            puts = Call(lambda: [store.put(k, v) for k, v in zip(keys, values)])
            wait_until(lambda: all(disk.contains(k.id) for k in keys[:queued])
                       and store.stats().write_behind_pending_bytes == (queued + 1) * size,
                       what="the pfs's queue full, and the next put holding room on the disk while it waits")
            assert not puts.finished.is_set()
            clock.advance(6.0)  # the pfs's copies in flight made no progress for stall_s
            puts.outcome(timeout_s=30)
            wait_until(lambda: all(disk.contains(k.id) for k in keys), what="every copy on disk")
            assert all(loads(store, k, v) for k, v in zip(keys, values))
            assert store.stats().write_behind_dropped == len(keys) - queued
            with pytest.raises(TierUnavailable, match="pfs: write-behind is stalled"):
                store.put(keys[0], values[0], durable=True)
        finally:
            hang.open()
        assert store.flush(timeout_s=30)


def test_13_a_disk_holding_room_for_a_put_that_waits_on_a_stalled_tier_is_busy_not_stalled(tmp_path, monkeypatch):
    """Found in CI through the test above: a put reserves its copies' queue room tier by
    tier, and held the disk's while it waited for room in the hung pfs's queue. The disk,
    with nothing to run meanwhile, counted that wait as stall_s without a copy done, so the
    next put, while the disk wrote the waiting put's copy, skipped it. The stall clock now
    runs only while a tier has copies in flight."""
    clock = ManualClock()
    monkeypatch.setattr(kvstore.store.write_behind, "time", clock)
    keys, values = chunks(4)
    size = blob_size(values[0], "raw")
    store, (disk, pfs) = faulty_store(tmp_path, names=("disk", "pfs"), stall_s=5.0, delay_s=0,
                                      pending=2 * size)
    with store:
        hang = pfs.gates["write"] = Gate()
        busy = disk.gates["write"] = Gate(keys[2].id)
        try:
            for key, value in zip(keys[:2], values[:2]):
                store.put(key, value)  # the pfs's queue is full: one copy hangs, one waits
            wait_until(lambda: disk.contains(keys[0].id) and disk.contains(keys[1].id), what="the disk's copies")
            waits = Call(lambda: store.put(keys[2], values[2]))
            wait_until(lambda: store.stats().write_behind_pending_bytes == 3 * size,
                       what="the put holding room on the disk while it waits for the pfs")
            clock.advance(6.0)  # the pfs is stalled; the disk had nothing in flight
            waits.outcome(timeout_s=30)
            assert busy.entered.wait(10)  # the disk writes the put's copy
            store.put(keys[3], values[3])
            assert store.stats().write_behind_dropped == 2  # the pfs's copies, not the disk's
        finally:
            busy.open()
            hang.open()
        wait_until(lambda: disk.contains(keys[3].id), what="the next put's copy on disk")
        assert store.flush(timeout_s=30)


def test_13_a_put_into_a_first_tier_held_by_copies_to_a_hung_tier_fails_instead_of_waiting_forever(tmp_path):
    """Found by the fault campaign with placement: with host RAM full of pinned chunks and
    chunks whose copies wait for a hung disk, a put waited for those copies with no bound.
    Copies still waiting in the queue of a stalled tier are dropped to make room
    (tests/store/test_write_behind_backpressure.py); these four are running on the hung disk, and
    hold their chunks until it answers."""
    store, (disk,) = faulty_store(tmp_path, workers=4, stall_s=0.5, host=8 * PAGE, pending=4 * PAGE)
    keys, values = chunks(9)
    with store:
        hang = disk.gates["write"] = Gate()
        for key, value in zip(keys[:4], values[:4]):
            store.put(key, value)  # each queues a copy (the queue has room for four)
        wait_until(lambda: hang.waiting == 4, what="every copy running on the hung disk")
        for key, value in zip(keys[4:8], values[4:8]):
            store.put(key, value)  # queued behind them, or skipped once the disk is stalled
        store.pin(keys[4:8], 60.0)
        with store.index.lock:
            assert all(store.index.get(k.id).copying for k in keys[:4])
        put = Call(lambda: store.put(keys[8], values[8]))
        try:
            with pytest.raises(TierFull, match="stalled"):
                put.outcome(timeout_s=10)
        finally:
            hang.open()
        assert store.flush(timeout_s=30)
        store.put(keys[8], values[8])  # the copies are done: their chunks can go


def test_13_a_read_that_finds_a_corrupt_copy_does_not_wait_for_a_hung_writer_of_that_key(tmp_path):
    """Found by the fault campaign with placement: a reader dropped a corrupt disk copy by
    deleting it under the key's disk lock, which a hung write of that key (a re-encoding in
    place) held: the read waited as long as the disk hung."""
    store, (disk,) = faulty_store(tmp_path)
    keys, values = chunks(1)
    with store:
        store.put(keys[0], values[0])
        assert store.flush(timeout_s=30)
        store.drop(keys, "host")
        disk.flip_reads = 1
        writer_holds, release = threading.Event(), threading.Event()

        def hung_writer():
            with store._locks.hold("disk", keys[0].id):
                writer_holds.set()
                release.wait(30)

        writer = Call(hung_writer)
        assert writer_holds.wait(10)
        try:
            assert Call(lambda: store.get_into(keys[0], torch.empty_like(values[0]))).outcome(timeout_s=5) is False
        finally:
            release.set()
        writer.outcome()
        wait_until(lambda: not disk.contains(keys[0].id), what="the corrupt copy deleted")


# -- #15: what durable means -----------------------------------------------------------------------------


def test_15_a_durable_put_syncs_its_files_and_a_write_behind_copy_does_not(tmp_path, monkeypatch):
    """A write-behind copy syncs nothing, neither its file nor the fan-out directories it
    created. A durable put syncs its file, the directory holding it and, the first time, each
    new fan-out directory's entry in its parent, including the directories a write-behind
    copy of the same chunk created unsynced before."""
    files, dirs = [], []
    fsync = os.fsync

    def counted(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        (dirs if os.path.isdir(path) else files).append(path)
        fsync(fd)

    monkeypatch.setattr(os, "fsync", counted)
    keys, values = chunks(2)
    with Store(store_config(tmp_path)) as store:
        disk = store.tier("disk")
        root = str(disk.root.resolve())

        def durable_dirs(key):  # the file's directory, then each fan-out level's parent
            inner = disk.path_of(key.id).parent.resolve()
            return [str(inner), str(inner.parent), root]

        store.put(keys[0], values[0])
        store.flush()
        assert files == [] and dirs == []
        store.put(keys[1], values[1], durable=True)
        assert files == [str(disk.path_of(keys[1].id).resolve())]
        assert dirs == durable_dirs(keys[1])
        files.clear(), dirs.clear()
        store.put(keys[0], values[0], durable=True)  # already on disk: now synced too
        assert files == [str(disk.path_of(keys[0].id).resolve())]
        assert dirs == durable_dirs(keys[0])  # the write-behind copy's new directories too
        files.clear(), dirs.clear()
        store.put(keys[0], values[0], durable=True)  # synced already: nothing again
        assert files == [] and dirs == []


def test_15_zero_length_and_truncated_files_at_start_are_removed_never_reported_present(tmp_path):
    keys, values = chunks(3)
    with Store(store_config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v)
        paths = [store.tier("disk").path_of(k.id) for k in keys]
    paths[0].write_bytes(b"")
    paths[1].write_bytes(paths[1].read_bytes()[:500])
    with Store(store_config(tmp_path)) as store:
        assert store.lookup(keys[:1]) == 0 and store.lookup(keys[1:2]) == 0
        assert store.lookup(keys[2:]) == 1 and loads(store, keys[2], values[2])
        assert store.stats().tiers["disk"].corruptions == 2
        assert not paths[0].exists() and not paths[1].exists()


# -- #17: a promotion racing delete ------------------------------------------------------------------


def test_17_a_reads_promotion_racing_delete_does_not_bring_the_chunk_back(tmp_path, monkeypatch):
    keys, values = chunks(1)
    promotion = Gate(keys[0].id, times=1)
    write = HostTier.write

    def gated_write(self, k, parts):
        promotion.pass_through(k)
        return write(self, k, parts)

    with Store(store_config(tmp_path)) as store:
        store.put(keys[0], values[0], durable=True)
        store.drop(keys, "host")
        monkeypatch.setattr(HostTier, "write", gated_write)
        read = Call(lambda: loads(store, keys[0], values[0]))
        assert promotion.entered.wait(10)
        assert store.delete(keys) == 1
        promotion.open()
        assert read.outcome()
        assert store.lookup(keys) == 0 and len(store.first) == 0


# -- #19 (the Store's side): prefetch ------------------------------------------------------------------


def test_19_prefetch_is_deduplicated_and_bounded(tmp_path):
    store, (disk,) = faulty_store(tmp_path, prefetch_max_inflight=2)
    keys, values = chunks(5)
    with store:
        _on_disk_only(store, keys, values)
        gate = disk.gates["read"] = Gate()
        first = store.prefetch(keys[:1])
        assert len(first) == 1 and store.prefetch(keys[:1]) == []
        more = store.prefetch(keys[1:])
        assert len(more) == 1  # two at once at most
        gate.open()
        assert all(f.result(timeout=10) is not None for f in first + more)
        assert store.first.contains(keys[0].id) and store.first.contains(keys[1].id)


def test_10_a_short_pin_after_an_unpin_of_a_long_one_ends_on_time(tmp_path):
    """Found by the fault campaign: the pin heap kept the long pin's expiry, so the chunk
    stayed out of its policies (unevictable) until then."""
    keys, values = chunks(1)
    with Store(store_config(tmp_path, disk=None)) as store:
        store.put(keys[0], values[0])
        store.pin(keys, ttl_s=600)
        store.unpin(keys)
        store.pin(keys, ttl_s=0.01)
        wait_until(lambda: store.stats().pinned == 0, what="the short pin to end")
        store.check_integrity()  # back in its policy, evictable


def test_a_durable_put_of_a_present_chunk_deleted_while_it_waits_for_queue_room_loses_nothing(tmp_path):
    """Found by the concurrency test: the durable put queued its copy for the chunk's old
    entry after a delete and a re-put replaced it, overwriting the new entry's queued copy;
    the queue's byte count then never went back to zero (flush hung)."""
    store, (disk,) = faulty_store(tmp_path, workers=2, pending=2 * PAGE)
    keys, values = chunks(8)
    with store:
        store.put(keys[0], values[0])
        store.flush()
        gate = disk.gates["write"] = Gate()
        for k, v in zip(keys[1:], values[1:]):  # the disk hangs: its queue fills up
            store.put(k, v)
        durable = Call(lambda: store.put(keys[0], values[0], durable=True))  # waits for queue room
        assert not durable.finished.wait(0.3)
        store.delete(keys[:1])
        again = Call(lambda: store.put(keys[0], values[0]))  # a new entry, also waiting for room
        again.finished.wait(0.3)
        gate.open()
        again.outcome()
        durable.outcome()
        assert store.flush(timeout_s=30), "copies never finished: the queue's books leaked"
        assert store.lookup(keys) == 8 and loads(store, keys[0], values[0])


def test_13_a_drop_of_host_copies_does_not_wait_for_a_hung_replica_tier(tmp_path):
    """Suspected in issue 36, confirmed: ``Store.drop`` (a daemon's quota eviction from host
    RAM) waited for every queued copy of its keys with no bound, so a replica tier that hung
    held each eviction, and in a daemon every executor thread in turn, for as long as it
    hung. Now it waits only while those copies' tiers make progress (``write_behind.stall_s``),
    and keeps the host copy of a chunk whose copy still waits on a stalled tier (dropped, its
    copy there could never be made: the first tier's copy is its source)."""
    store, (disk, pfs) = faulty_store(tmp_path, names=("disk", "pfs"), workers=1, stall_s=0.3)
    keys, values = chunks(3)
    with store:
        store.put(keys[2], values[2])
        assert store.flush(timeout_s=30)  # copied everywhere before the tier hangs
        hang = pfs.gates["write"] = Gate()
        try:
            for key, value in zip(keys[:2], values[:2]):
                store.put(key, value)
            wait_until(lambda: all(disk.contains(k.id) for k in keys[:2]), what="the disk's copies")
            assert Call(lambda: store.drop(keys, "host")).outcome(timeout_s=10) == 1
            assert not store.first.contains(keys[2].id)
            assert all(store.first.contains(k.id) for k in keys[:2])  # their pfs copies still need them
            assert all(loads(store, k, v) for k, v in zip(keys, values))
        finally:
            hang.open()
        assert store.flush(timeout_s=30)
        assert all(pfs.contains(k.id) for k in keys)
