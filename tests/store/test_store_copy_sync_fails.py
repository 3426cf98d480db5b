"""A durable put whose disk copy was written but whose fsync failed.
WriteBehind._write (kvstore/store/write_behind.py) runs ``tier.write`` then ``tier.sync`` in one
try: when the sync raises (EIO from fsync: a real disk error), the copy is treated as never
written, and the index is not told of the file that ``write`` put under the chunk's name.
The tier holds (and counts) a file the index does not list: an orphan that no eviction can
choose and that ``Store.delete`` does not remove (it deletes the replicas the index lists).
So after the put raised, the caller deletes the chunk, the delete returns, and at the next
start the chunk is back (docs/store.md: "a deleted chunk never comes back, not even after a
crash"); meanwhile the file holds disk capacity nothing can free."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from helpers import chunks, store_config
from kvstore.store import Store
from tiers.base import TierError


def test_a_copy_whose_sync_failed_is_still_deleted_with_its_chunk(tmp_path, monkeypatch):
    keys, values = chunks(1)
    cfg = store_config(tmp_path)
    cfg.disk.fetch_workers = 1
    with Store(cfg) as store:
        path = str(store.tier("disk").path_of(keys[0].id))
        real_fsync = os.fsync
        failed = []

        def fsync(fd):  # the disk reports an I/O error for this file's first fsync
            if not failed and os.readlink(f"/proc/self/fd/{fd}") == path:
                failed.append(fd)
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", fsync)
        with pytest.raises(TierError):
            store.put(keys[0], values[0], durable=True)  # not acknowledged: fine
        monkeypatch.undo()
        assert failed
        assert store.delete(keys) == 1
        assert not os.path.exists(path), "the chunk's file stays on disk after its delete returned"
    with Store(cfg) as store:
        assert not store.get_into(keys[0], torch.empty_like(values[0])), "the deleted chunk is back after a restart"
