"""A write-behind copy that is still making room on its tier when its chunk is deleted writes
nothing afterwards (kvstore/store/write_behind.py ``_write`` checks, under the key lock, that the
job's entry is still the key's). Before the fix it wrote the deleted chunk's file after
``Store.delete`` returned (its deleter found no copy holding the key lock to wait for), then
removed it again: a crash in between brought the deleted chunk back at start."""

from __future__ import annotations

from faults import Call, Gate, wait_until
from kvstore.store import Store
from placed_chunks import chunks, config, disk_tier


def test_a_copy_making_room_when_its_chunk_is_deleted_writes_nothing(tmp_path):
    keys, values = chunks(4)
    disk = disk_tier(tmp_path, 3)
    with Store(config(tmp_path), extra_tiers=[disk]) as store:
        for key, value in zip(keys[:3], values[:3]):
            store.put(key, value)
        assert store.flush(timeout_s=30)  # the disk is full
        victim = disk.gates["delete"] = Gate(key=keys[0].id, times=1)
        store.put(keys[3], values[3])  # its copy evicts keys[0] from disk first: held there
        wait_until(victim.entered.is_set, what="the copy making room")
        store.delete([keys[3]])  # "returns once its files are gone and no copy of it is being written"
        late = disk.gates["write"] = Gate(key=keys[3].id, times=1)  # a write of keys[3] now is too late
        victim.open()
        flushing = Call(lambda: store.flush(timeout_s=30))
        wait_until(lambda: flushing.finished.is_set() or late.entered.is_set(), what="the copy's end")
        wrote_after_delete = late.entered.is_set()
        late.open()
        assert flushing.outcome()
        assert not disk.inner.path_of(keys[3].id).exists()
    assert not wrote_after_delete, "a copy wrote the chunk's file after delete() returned"
    with Store(config(tmp_path), extra_tiers=[disk_tier(tmp_path, 3)]) as store:
        assert not store.contains(keys[3])
