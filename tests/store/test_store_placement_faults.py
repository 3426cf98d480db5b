"""Regression tests for what the fault campaign found once placement re-encoded copies and
the disk tier filled up (tests/store/store_model.py with ``placement=True``). Each fails without
its fix: named in its docstring."""

from __future__ import annotations

import torch

from faults import Call, Gate, wait_until
from helpers import PAGE
from kvstore.store import Store
from placed_chunks import RAW_UNITS, chunks, config, disk_tier
from tiers.base import TierFull
from tiers.disk import DiskTier

def test_a_durable_chunks_disk_copy_re_encoded_in_place_is_synced(tmp_path):
    """Evictor._replace wrote the re-encoded copy of a synced file without syncing it, and
    the index kept calling it synced: a power loss then took a durable put."""
    keys, values = chunks(4)
    disk = disk_tier(tmp_path, 3)
    with Store(config(tmp_path, placement=True), extra_tiers=[disk]) as store:
        store.put(keys[0], values[0], durable=True)
        store.drop([keys[0]], "host")  # only the disk holds it: re-encoding beats recomputing
        for key, value in zip(keys[1:], values[1:]):  # the fourth raw copy evicts the oldest, keys[0]
            store.put(key, value)
        assert store.flush(timeout_s=30)
        assert store.stats().tiers["disk"].recodes == 1
        assert keys[0].id in disk.inner.keys() and keys[0].id not in disk.unsynced


def test_a_copy_replacing_a_file_found_at_start_is_synced(tmp_path):
    """Files found at start counted as unsynced, so a plain re-put's copy replaced a durable
    put's file with one a power loss could take (the never-downgrade rule did not apply)."""
    keys, values = chunks(1)
    with Store(config(tmp_path), extra_tiers=[disk_tier(tmp_path, 4)]) as store:
        store.put(keys[0], values[0], durable=True)
    disk = disk_tier(tmp_path, 4)
    with Store(config(tmp_path), extra_tiers=[disk]) as store:
        store.put(keys[0], values[0], codec="int8")  # another encoding: a new version, copied to disk
        assert store.flush(timeout_s=30)
        assert disk.calls.get("write") == 1 and keys[0].id not in disk.unsynced


def test_a_replacing_write_counts_the_old_file_until_the_new_one_replaces_it(tmp_path):
    """DiskTier.write let a rewrite of a key on a full tier through (its old bytes were
    subtracted up front), so while the new file was written the tier used more than its
    capacity, and on the medium both files were there."""
    tier = DiskTier(tmp_path / "disk", 2 * PAGE, name="disk")
    seen = []
    write_temp = tier._write_temp

    def watched(*args):
        seen.append(tier.used_bytes)
        return write_temp(*args)

    tier._write_temp = watched
    tier.write(b"a" * 32, [b"x" * PAGE])
    tier.write(b"b" * 32, [b"y" * PAGE])
    try:
        tier.write(b"a" * 32, [b"z" * PAGE])
    except TierFull:
        pass
    assert max(seen) <= tier.capacity_bytes
    tier.delete(b"b" * 32)
    tier.write(b"a" * 32, [b"z" * PAGE])  # with room for both, the rewrite goes through
    assert tier.read(b"a" * 32) == b"z" * PAGE and tier.used_bytes == PAGE


def test_integrity_does_not_take_a_victim_waiting_for_its_delete_for_an_orphan(tmp_path):
    """Victims leave the index at once and are deleted one after another after the lock is
    released; check_integrity called the second an orphan while the first's delete ran."""
    keys, values = chunks(3)
    disk = disk_tier(tmp_path, 3)
    with Store(config(tmp_path), extra_tiers=[disk]) as store:
        for key, value in zip(keys, values):
            store.put(key, value)
        assert store.flush(timeout_s=30)
        gate = disk.gates["delete"] = Gate(times=1)
        evicting = Call(lambda: store._evictor.make_room(disk, 2 * RAW_UNITS * PAGE))
        wait_until(gate.entered.is_set, what="the first victim's delete")
        store.check_integrity()
        gate.open()
        evicting.outcome()
        assert len(list(disk.inner.keys())) == 1


def test_a_re_encoding_that_outlives_its_chunk_leaves_the_chunks_next_entry_alone(tmp_path):
    """A victim's re-encoding whose chunk was deleted and put again meanwhile synced the old
    entry with the policies: it held no replica, so every tier's policy dropped the key,
    now the new entry's, and that entry could never be evicted. Found by the long walk with
    placement (seed 7): "policy lacks it, though it is evictable there" in host and disk."""
    keys, values = chunks(3)
    disk = disk_tier(tmp_path, 3)
    with Store(config(tmp_path, placement=True), extra_tiers=[disk]) as store:
        for key, value in zip(keys, values):
            store.put(key, value)
        assert store.flush(timeout_s=30)
        store.drop([keys[0]], "host")  # only the disk holds it: worth re-encoding when evicted
        gate = disk.gates["read"] = Gate(key=keys[0].id)
        evicting = Call(lambda: store._evictor.make_room(disk, RAW_UNITS * PAGE))
        wait_until(gate.entered.is_set, what="the re-encoding's read of the victim")
        store.delete([keys[0]])
        store.put(keys[0], values[0])  # a new entry, copied to disk in the room the delete freed
        assert store.flush(timeout_s=30)
        gate.open()
        evicting.outcome()
        store.check_integrity()
        assert torch.equal(store.get([keys[0]])[0], values[0])


def test_a_read_that_finds_a_corrupt_copy_leaves_the_copy_that_replaced_it_alone(tmp_path):
    """A read that found its copy corrupt dropped whatever copy the index listed in that tier
    by then, and deleted its file: a durable re-put that replaced the corrupt copy while
    the read checked it lost its disk copy (and so its durability)."""
    keys, values = chunks(1)
    disk = disk_tier(tmp_path, 4)
    with Store(config(tmp_path), extra_tiers=[disk]) as store:
        store.put(keys[0], values[0])
        assert store.flush(timeout_s=30)
        store.drop([keys[0]], "host")  # read from disk
        disk.flip_reads = 1  # the medium returns the old copy with a byte flipped
        gate = disk.gates["read_done"] = Gate(key=keys[0].id, times=1)
        reading = Call(lambda: store.get([keys[0]]))
        wait_until(gate.entered.is_set, what="the read of the old copy")
        store.put(keys[0], values[0], codec="int8", durable=True)  # a new version, on disk and synced
        gate.open()
        reading.outcome()
    assert keys[0].id in disk.inner.keys() and keys[0].id not in disk.unsynced
    with Store(config(tmp_path), extra_tiers=[disk_tier(tmp_path, 4)]) as store:
        assert store.contains(keys[0])
