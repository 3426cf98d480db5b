"""tiers/read_probe.py: the disk tier's cold reads in flight are the best measured, kept per
device and in the data directory, with a fallback where cold reads cannot be measured."""

import os

import pytest

from tiers import read_probe
from tiers.read_probe import FALLBACK, RESULT_NAME, best_inflight, read_parallelism


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(read_probe, "_measured", {})
    monkeypatch.setattr(read_probe, "PROBE_FILES", 4)
    monkeypatch.setattr(read_probe, "PROBE_FILE_BYTES", 64 << 10)


def test_best_inflight_is_the_fastest_setting_and_every_run_starts_cold(tmp_path, monkeypatch):
    paths = []
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(os.urandom(64 << 10))
        paths.append(str(tmp_path / f"f{i}"))
    try:
        read_probe.drop_cache(paths)
    except read_probe.StillCached:
        pytest.skip("this file system keeps pages cached")
    real = read_probe.read_all

    def read_all(ps, n, direct, read_bytes=None, buffers=None):
        assert all(read_probe.cached_bytes(p) == 0 for p in ps)
        real(ps, n, direct, read_bytes, buffers)

    monkeypatch.setattr(read_probe, "read_all", read_all)
    n, seconds = best_inflight(paths, direct=False, read_bytes=16 << 10)
    assert set(seconds) == set(read_probe.INFLIGHT)
    assert seconds[n] == min(seconds.values())


def test_measured_once_per_device_then_read_back_from_the_data_directory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(read_probe, "_probe", lambda root, direct, suffix, read_bytes: calls.append(root) or 2)
    assert read_parallelism(str(tmp_path)) == 2
    assert read_parallelism(str(tmp_path)) == 2
    assert len(calls) == 1
    assert (tmp_path / RESULT_NAME).exists()
    monkeypatch.setattr(read_probe, "_measured", {})  # a later process: the saved answer, no probe
    assert read_parallelism(str(tmp_path)) == 2 and len(calls) == 1


def test_the_probe_leaves_no_files_and_falls_back_where_reads_stay_cached(tmp_path, monkeypatch):
    def still_cached(paths):
        raise read_probe.StillCached("tmpfs")

    monkeypatch.setattr(read_probe, "drop_cache", still_cached)
    assert read_parallelism(str(tmp_path)) == FALLBACK
    assert sorted(os.listdir(tmp_path)) == [RESULT_NAME]


def test_the_disk_tier_gets_the_measured_fetch_workers_unless_configured(tmp_path, monkeypatch):
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
    from kvstore.tier_setup import build_tiers

    monkeypatch.setattr(read_probe, "_probe", lambda root, direct, suffix, read_bytes: 3)
    for configured, expected in ((0, 3), (5, 5)):
        cfg = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, prefault=False),
                          disk=DiskTierConfig(path=str(tmp_path / f"d{configured}"), capacity_bytes=1 << 20,
                                              fetch_workers=configured))
        setups = build_tiers(cfg)
        try:
            assert {s.tier.name: s.fetch_workers for s in setups}["disk"] == expected
        finally:
            for s in setups:
                s.tier.close()


def test_an_answer_saved_by_the_old_probe_is_measured_again(tmp_path, monkeypatch):
    """The first probe counted its buffers' page faults as disk time, which favoured few reads
    in flight; its saved answers (no version) would have been kept for every later start."""
    import json

    (tmp_path / RESULT_NAME).write_text(json.dumps({"inflight": {"false": 1}}))
    monkeypatch.setattr(read_probe, "_probe", lambda root, direct, suffix, read_bytes: 8)
    assert read_parallelism(str(tmp_path)) == 8
    monkeypatch.setattr(read_probe, "_measured", {})
    monkeypatch.setattr(read_probe, "_probe", lambda root, direct, suffix, read_bytes: 3)
    assert read_parallelism(str(tmp_path)) == 8  # saved now in this version: read back
