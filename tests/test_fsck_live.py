"""``kvstore fsck`` on the data directory of a live daemon or Store. A repair treats every
``*.tmp`` file as a crash leftover and unlinks it; it took no lock, although the directory's
``flock`` (tiers/files.py, DirectoryLock) says a live process owns it and may be writing
that very file: the live write's rename then failed (ENOENT) and a durable put raised,
though nothing was wrong with the store. A repair of a directory in use is now refused, as
a second DiskTier on it is (docs/store.md, "One owner per data directory"); a check, which
only reads, runs beside the live process."""

from __future__ import annotations

import os
import threading

import torch

from faults import Call, wait_until
from helpers import chunks, same, store_config
from kvstore.cli import main
from kvstore.store import Store
from tiers.files import SUFFIX


def test_fsck_repair_on_a_live_data_directory_does_not_break_a_put_in_flight(tmp_path, monkeypatch, capsys):
    keys, values = chunks(1)
    cfg = store_config(tmp_path)
    cfg.disk.fetch_workers = 1
    data = tmp_path / "data"
    entered, release = threading.Event(), threading.Event()
    real_replace = os.replace

    def held_replace(src, dst, *a, **kw):  # the disk copy's temporary file is written, not yet renamed
        if str(dst).endswith(SUFFIX) and str(dst).startswith(str(data)):
            entered.set()
            assert release.wait(10)
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", held_replace)
    with Store(cfg) as store:
        put = Call(lambda: store.put(keys[0], values[0], durable=True))
        wait_until(entered.is_set, what="the disk copy to reach its rename")
        rc = main(["fsck", "--repair", "--data-dir", str(data)])  # an operator's fsck, daemon live
        release.set()
        put.outcome()  # raised TierUnavailable: fsck removed the live write's temporary file
        out = torch.empty_like(values[0])
        assert store.get_into(keys[0], out) and same(out, values[0])
    assert rc != 0, "fsck --repair ran on a directory a live process holds"


def test_a_check_without_repair_runs_beside_a_live_store(tmp_path, capsys):
    keys, values = chunks(3)
    with Store(store_config(tmp_path)) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert main(["fsck", "--data-dir", str(tmp_path / "data")]) == 0
        assert "3" in capsys.readouterr().out
