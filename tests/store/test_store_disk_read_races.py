"""A disk read that finds its file gone, racing the writes and deletes of the same key
(tiers/disk.py): the tier forgets the key only if the file is still gone under the key's
stripe, so a re-put's file that landed meanwhile stays counted, listed and deletable."""

from __future__ import annotations

import os

import tiers.disk as disk_module
from faults import Call, Gate, wait_until
from kvstore.store import Store
from placed_chunks import chunks, config, disk_tier


def _race(store, disk, key, value, monkeypatch):
    """A disk read of ``key`` is held before it opens the file; the chunk is deleted; the open
    fails, and the read is held again before it acts on that; a durable re-put writes a new
    file; then the read goes on."""
    path = str(disk.inner.path_of(key.id))
    before_open, after_failed_open = Gate(times=1), Gate(times=1)
    real_open = os.open

    def gated_open(p, flags, *args, **kw):
        if str(p) != path or flags != os.O_RDONLY:
            return real_open(p, flags, *args, **kw)
        before_open.pass_through(b"")
        try:
            return real_open(p, flags, *args, **kw)
        except FileNotFoundError:
            after_failed_open.pass_through(b"")
            raise

    monkeypatch.setattr(disk_module.os, "open", gated_open)
    reading = Call(lambda: store.get([key]))
    wait_until(before_open.entered.is_set, what="the disk read past its size lookup")
    store.delete([key])
    before_open.open()
    wait_until(after_failed_open.entered.is_set, what="the read finding the file gone")
    store.put(key, value, durable=True)  # acknowledged: on disk and synced
    after_failed_open.open()
    reading.outcome()
    monkeypatch.undo()


def test_a_durable_put_is_not_forgotten_by_a_read_that_raced_an_earlier_delete(tmp_path, monkeypatch):
    """Before the fix the read forgot the key outside the stripe: the re-put's file left the
    tier's view and then the index, though the disk never evicted it."""
    keys, values = chunks(1)
    disk = disk_tier(tmp_path, 4)
    with Store(config(tmp_path), extra_tiers=[disk]) as store:
        store.put(keys[0], values[0])
        assert store.flush(timeout_s=30)
        store.drop([keys[0]], "host")  # read from disk
        _race(store, disk, keys[0], values[0], monkeypatch)
        store.drop([keys[0]], "host")
        assert store.contains(keys[0]), "durable put lost though the disk never evicted it"
        assert disk.inner.size_of(keys[0].id) is not None, "the disk tier forgot a file it holds"


def test_a_chunk_deleted_after_that_race_does_not_come_back(tmp_path, monkeypatch):
    """Before the fix the forgotten file was not deleted by a later delete, and a restart
    found the chunk again."""
    keys, values = chunks(1)
    with Store(config(tmp_path), extra_tiers=[disk_tier(tmp_path, 4)]) as store:
        store.put(keys[0], values[0])
        assert store.flush(timeout_s=30)
        store.drop([keys[0]], "host")
        _race(store, store.tier("disk"), keys[0], values[0], monkeypatch)
        store.delete([keys[0]])
        assert not store.contains(keys[0])
    with Store(config(tmp_path), extra_tiers=[disk_tier(tmp_path, 4)]) as store:
        assert not store.contains(keys[0]), "a deleted chunk came back after a clean restart"
