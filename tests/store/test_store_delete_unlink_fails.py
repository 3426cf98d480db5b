"""A delete whose ``unlink`` fails. DiskTier.delete (tiers/disk.py) drops
the key from its size map and then calls ``unlink_quietly``, which swallows every OSError
(EIO, EROFS after an ext4 error remount, EACCES, EBUSY): the tier reports the value gone, the
Store's delete returns as if done (no error counted, nothing raised), the file stays on the
disk uncounted by ``used_bytes``, and at the next start recovery indexes it again: a chunk
whose delete returned comes back (docs/store.md: "delete returns once every file of the
chunk is gone ...: a deleted chunk never comes back, not even after a crash")."""

from __future__ import annotations

import errno
import os

import torch

from helpers import chunks, same, store_config
from kvstore.store import Store
from tiers.base import TierError
from tiers.files import SUFFIX


def test_a_delete_whose_unlink_fails_is_not_reported_done(tmp_path, monkeypatch):
    keys, values = chunks(1)
    cfg = store_config(tmp_path)
    cfg.disk.fetch_workers = 1
    data = str(tmp_path / "data")
    with Store(cfg) as store:
        store.put(keys[0], values[0], durable=True)
        real_unlink = os.unlink

        def failing_unlink(path, *a, **kw):  # the medium refuses the unlink (an I/O error)
            if str(path).endswith(SUFFIX) and str(path).startswith(data):
                raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
            return real_unlink(path, *a, **kw)

        monkeypatch.setattr(os, "unlink", failing_unlink)
        try:
            store.delete(keys)
            reported_done = True
        except TierError:
            reported_done = False  # the caller is told the chunk's file is still there
        monkeypatch.undo()
        disk = store.tier("disk")
        on_disk = os.path.exists(disk.path_of(keys[0].id))
        assert on_disk
        # the file is still on the medium: the tier must still count its bytes
        assert disk.used_bytes >= os.stat(disk.path_of(keys[0].id)).st_size, "a file on disk the tier no longer counts"
        errors = store.stats().tiers["disk"].errors
    with Store(cfg) as store:
        out = torch.empty_like(values[0])
        back = store.get_into(keys[0], out)
    assert not (reported_done and back), (
        f"delete returned as done (disk errors counted: {errors}), and after a restart the deleted chunk is back")
