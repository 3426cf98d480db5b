"""Before the fix, a deleted chunk came back after a power loss. ``Store.delete`` returns
once DiskTier.delete has unlinked the file (tiers/disk.py ``delete``: ``unlink_quietly``),
but nothing fsyncs the directory after the unlink: the removal is only in the page cache /
the file system's open journal transaction, and a power loss before it is written back
(ext4 commits every 5 s, XFS logs lazily, a PFS server later still) brings the directory
entry back: the restarted Store finds and serves the chunk whose delete was acknowledged.
docs/store.md: "delete returns once every file of the chunk is gone ...: a deleted chunk
never comes back, not even after a crash". The durable put's own directory fsync (sync)
shows the project knows a directory entry needs one.

The medium is modelled under the real DiskTier by wrapping ``os.unlink`` and ``os.fsync``:
an unlink is durable once its directory is fsync'ed (or the file system synced); a crash
image taken at a moment puts back every file whose unlink is not durable yet."""

from __future__ import annotations

import os
import shutil
import stat
import threading

import torch

import tiers.disk
from helpers import chunks, same, store_config
from kvstore.store import Store
from tiers.files import SUFFIX


class Medium:
    def __init__(self, monkeypatch, root) -> None:
        self.root = str(root)
        self.pending: dict[str, tuple[str, bytes]] = {}  # path -> (its directory, its bytes)
        self.lock = threading.Lock()
        real_unlink, real_fsync = os.unlink, os.fsync

        def unlink(path, *a, **kw):
            path = os.path.abspath(str(path))
            data = None
            if path.endswith(SUFFIX) and path.startswith(self.root):
                with open(path, "rb") as f:
                    data = f.read()
            real_unlink(path, *a, **kw)
            if data is not None:
                with self.lock:
                    self.pending[path] = (os.path.dirname(path), data)

        def fsync(fd):
            real_fsync(fd)
            st = os.fstat(fd)
            if stat.S_ISDIR(st.st_mode):
                with self.lock:
                    for path, (directory, _) in list(self.pending.items()):
                        d = os.stat(directory)
                        if (d.st_dev, d.st_ino) == (st.st_dev, st.st_ino):
                            del self.pending[path]

        def sync_filesystem(path):
            os.sync()
            with self.lock:
                self.pending.clear()

        monkeypatch.setattr(os, "unlink", unlink)
        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(tiers.disk, "sync_filesystem", sync_filesystem)

    def image(self, dest) -> None:
        """The data directory as a power loss now would leave it."""
        with self.lock:
            shutil.copytree(self.root, dest, ignore=shutil.ignore_patterns(".lock"))
            for path, (_, data) in self.pending.items():
                target = os.path.join(dest, os.path.relpath(path, self.root))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with open(target, "wb") as f:
                    f.write(data)


def test_a_deleted_chunk_does_not_come_back_after_a_power_loss(tmp_path, monkeypatch):
    keys, values = chunks(2)
    cfg = store_config(tmp_path)
    cfg.disk.fetch_workers = 1
    medium = Medium(monkeypatch, tmp_path / "data")
    with Store(cfg) as store:
        for key, value in zip(keys, values):
            store.put(key, value, durable=True)
        assert store.delete(keys[:1]) == 1  # acknowledged
        medium.image(tmp_path / "image" / "data")  # the power fails right after
    monkeypatch.undo()
    with Store(store_config(tmp_path / "image")) as store:
        out = torch.empty_like(values[1])
        assert store.get_into(keys[1], out) and same(out, values[1])  # the durable put that stays
        assert not store.get_into(keys[0], torch.empty_like(values[0])), (
            "the chunk whose delete returned is back after a power loss")
