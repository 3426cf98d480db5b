"""Before the fix, a re-put's copy that replaces a durable put's disk file renames an
unsynced file over it and fsyncs it only afterwards (kvstore/store/write_behind.py ``_write``:
``tier.write`` then ``tier.sync``; tiers/disk.py ``write``: temp file, rename, no fsync of
the temp file before the rename). Between the rename and the fsync the only file under the
chunk's name holds data no sync covered: a power loss there leaves it empty or short
(the project's own medium model, tests/store/store_model.py: "files written since their last sync
come back empty"), recovery removes it as truncated, and the acknowledged durable put is
gone. docs/store.md: "a re-put replaces the file on disk only when its own copy lands, and
until then the older, whole file stays"; "a durable chunk's file is never replaced by an
unsynced one".

The medium is modelled under the real DiskTier by wrapping the os calls it makes: an inode
written (writev/pwritev/ftruncate) since its last fsync (or syncfs) is dirty, and a crash
image taken at a moment keeps every file, with dirty ones emptied. An image is taken right
after every rename into a final name: each is a state a power loss can leave behind.
"""

from __future__ import annotations

import os
import shutil
import threading

import torch

import tiers.disk
from helpers import chunks, same, store_config
from kvstore.store import Store
from tiers.files import SUFFIX


class Medium:
    """Which inodes hold data no fsync covered, and crash images of a data directory."""

    def __init__(self, monkeypatch, root, images) -> None:
        self.root, self.images = root, images
        self.dirty: set[tuple[int, int]] = set()
        self.lock = threading.Lock()
        self.taken = []
        real = {name: getattr(os, name) for name in ("writev", "pwritev", "write", "ftruncate", "fsync", "replace")}

        def inode(fd):
            st = os.fstat(fd)
            return st.st_dev, st.st_ino

        def writer(name):
            def wrapped(fd, *args):
                out = real[name](fd, *args)
                with self.lock:
                    self.dirty.add(inode(fd))
                return out
            return wrapped

        for name in ("writev", "pwritev", "write", "ftruncate"):
            monkeypatch.setattr(os, name, writer(name))

        def fsync(fd):
            real["fsync"](fd)
            with self.lock:
                self.dirty.discard(inode(fd))

        def sync_filesystem(path):
            os.sync()
            with self.lock:
                self.dirty.clear()

        def replace(src, dst, *a, **kw):
            real["replace"](src, dst, *a, **kw)
            if str(dst).endswith(SUFFIX) and str(dst).startswith(str(self.root)):
                self.image()

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(tiers.disk, "sync_filesystem", sync_filesystem)

    def image(self):
        """Copy the data directory as a power loss now would leave it."""
        with self.lock:
            dest = self.images / f"image{len(self.taken)}" / "data"
            shutil.copytree(self.root, dest, ignore=shutil.ignore_patterns(".lock"))
            for dirpath, _, files in os.walk(self.root):
                for name in files:
                    path = os.path.join(dirpath, name)
                    st = os.stat(path)
                    if (st.st_dev, st.st_ino) in self.dirty:
                        open(dest / os.path.relpath(path, self.root), "wb").close()
            self.taken.append(dest.parent)


def test_a_power_loss_during_a_re_put_keeps_the_durable_put(tmp_path, monkeypatch):
    keys, values = chunks(1)
    key, value = keys[0], values[0]
    cfg = store_config(tmp_path)
    cfg.disk.fetch_workers = 1
    medium = Medium(monkeypatch, tmp_path / "data", tmp_path / "images")
    with Store(cfg) as store:
        store.put(key, value, durable=True)  # acknowledged: file and directory fsync'ed
        acknowledged = len(medium.taken)
        store.put(key, value, codec="lz4")  # another blob of the chunk, copied behind
        assert store.flush(timeout_s=30)
    monkeypatch.undo()
    assert len(medium.taken) > acknowledged, "the re-put's copy never reached the disk"
    for image in medium.taken[acknowledged:]:
        icfg = store_config(image)
        icfg.disk.fetch_workers = 1
        with Store(icfg) as store:
            out = torch.empty_like(value)
            # raw or lz4: both decode to the exact bytes; a miss means the durable put was lost
            assert store.get_into(key, out), f"{image.name}: the acknowledged durable put is gone after a power loss"
            assert same(out, value)


def test_another_daemons_copy_never_replaces_a_durable_pfs_file_unsynced(tmp_path, monkeypatch):
    """Two daemons on one PFS directory (no shared index). Daemon X's durable put is on the
    PFS, synced. Daemon Y puts the same chunk (the key is the content address: the same
    bytes) without knowing of X's file: its copy behind is written to a temporary file and
    renamed over X's file, and never synced (Y's index has no synced copy there to "never
    downgrade"). Until the kernel writes it back, a power loss of the file server leaves
    the chunk's only file empty: X's acknowledged durable put is gone."""
    from tiers.pfs import PfsTier

    keys, values = chunks(1)
    key, value = keys[0], values[0]
    root = tmp_path / "pfs"
    medium = Medium(monkeypatch, root, tmp_path / "images")
    x_cfg, y_cfg = store_config(tmp_path / "x", disk=None), store_config(tmp_path / "y", disk=None)
    with Store(x_cfg, extra_tiers=[PfsTier(root, 1 << 20)]) as x, \
            Store(y_cfg, extra_tiers=[PfsTier(root, 1 << 20)]) as y:
        x.put(key, value, durable=True)  # acknowledged: on the PFS, file and directory fsync'ed
        y.put(key, value)  # the same chunk, copied behind
        assert y.flush(timeout_s=30)
        medium.image()  # a power loss now, after both puts returned and every copy is done
    monkeypatch.undo()
    image = medium.taken[-1]
    with Store(store_config(image / "z", disk=None), extra_tiers=[PfsTier(image / "data", 1 << 20)]) as z:
        out = torch.empty_like(value)
        assert z.get_into(key, out), "X's acknowledged durable put is gone after a power loss"
        assert same(out, value)
