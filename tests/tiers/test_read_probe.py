"""tiers/read_probe.py: the disk tier reads in the form (buffered or O_DIRECT) and with the
reads in flight that read cold files fastest, measured once per device and kept in the data
directory, with a fallback where cold reads cannot be measured."""

import json
import os

import pytest

from tiers import read_probe
from tiers.read_probe import FALLBACK, RESULT_NAME, cold_speeds, read_form, read_parallelism


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(read_probe, "_measured", {})
    monkeypatch.setattr(read_probe, "PROBE_FILES", 4)
    monkeypatch.setattr(read_probe, "PROBE_FILE_BYTES", 64 << 10)


def probed(speeds, calls=None):
    """A stand-in for the probe: ``speeds[form]`` as measured, recording which forms it was asked."""
    def probe(root, forms, suffix, read_bytes):
        if calls is not None:
            calls.append(tuple(forms))
        return {form: dict(speeds[form]) for form in forms}
    return probe


def test_cold_speeds_measure_both_forms_at_every_setting_each_run_cold(tmp_path, monkeypatch):
    paths = []
    for i in range(3):
        (tmp_path / f"f{i}").write_bytes(os.urandom(64 << 10))
        paths.append(str(tmp_path / f"f{i}"))
    try:
        read_probe.drop_cache(paths)
    except read_probe.StillCached:
        pytest.skip("this file system keeps pages cached")
    real, runs = read_probe.read_all, []

    def read_all(ps, n, direct, read_bytes=None, buffers=None, verify=False, outs=None):
        assert all(read_probe.cached_bytes(p) == 0 for p in ps)
        runs.append((direct, n, read_bytes, verify))
        real(ps, n, direct, read_bytes, buffers, verify, outs)

    monkeypatch.setattr(read_probe, "read_all", read_all)
    speeds = cold_speeds(paths, (False, True), read_bytes=16 << 10, verify=True)
    forms = (False, True) if read_probe.direct_supported(paths[0]) else (False,)
    assert {form: set(table) for form, table in speeds.items() if table} == {f: set(read_probe.INFLIGHT) for f in forms}
    # in turns, one setting at a time; buffered reads go in slices, O_DIRECT ones whole; all verified
    assert runs == [(form, n, None if form else 16 << 10, True) for n in read_probe.INFLIGHT for form in forms]


def test_a_verified_whole_read_is_copied_out_as_the_tier_copies_an_o_direct_read(tmp_path):
    """The probe judges O_DIRECT by what it costs the tier: the read, then the copy out of the
    staging buffer (hashed slice by slice), not the read alone."""
    data = os.urandom(600 << 10)
    (tmp_path / "f").write_bytes(data)
    paths = [str(tmp_path / "f")]
    buffers, outs = read_probe.read_buffers(paths, 1), read_probe.read_buffers(paths, 1)
    read_probe.read_all(paths, 1, read_probe.direct_supported(paths[0]), None, buffers, True, outs)
    assert outs[0][:len(data)] == data


def test_measured_once_per_device_then_read_back_from_the_data_directory(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(read_probe, "_probe", probed({False: {2: 1.0, 4: 0.5}}, calls))
    assert read_parallelism(str(tmp_path)) == 2
    assert read_parallelism(str(tmp_path)) == 2
    assert calls == [(False,)]
    assert (tmp_path / RESULT_NAME).exists()
    monkeypatch.setattr(read_probe, "_measured", {})  # a later process: the saved answer, no probe
    assert read_parallelism(str(tmp_path)) == 2 and calls == [(False,)]


def test_auto_takes_the_faster_form_and_measures_only_the_form_not_yet_known(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(read_probe, "_probe", probed({False: {2: 1.0, 4: 0.5}, True: {1: 0.9, 8: 1.6}}, calls))
    assert read_parallelism(str(tmp_path)) == 2  # buffered, measured alone
    assert read_form(str(tmp_path)) == (True, 8)  # both: O_DIRECT at 8 in flight reads fastest
    assert calls == [(False,), (True,)]
    monkeypatch.setattr(read_probe, "_measured", {})
    monkeypatch.setattr(read_probe, "_probe", probed({False: {1: 9.0}, True: {1: 9.0}}, calls))
    assert read_form(str(tmp_path)) == (True, 8) and len(calls) == 2  # both read back from the directory


def test_the_probe_leaves_no_files_and_falls_back_where_reads_stay_cached(tmp_path, monkeypatch):
    def still_cached(paths):
        raise read_probe.StillCached("tmpfs")

    monkeypatch.setattr(read_probe, "drop_cache", still_cached)
    assert read_form(str(tmp_path)) == (False, FALLBACK)
    assert sorted(os.listdir(tmp_path)) == [RESULT_NAME]


@pytest.mark.parametrize("o_direct, fetch_workers, expected", [
    ("auto", 0, (True, 8)),  # the faster form and its reads in flight
    ("auto", 5, (True, 5)),  # configured reads in flight, the measured form
    (False, 0, (False, 3)),  # configured form, its measured reads in flight
    (False, 5, (False, 5)),  # nothing measured
])
def test_the_disk_tier_gets_the_measured_form_and_reads_in_flight_unless_configured(
        tmp_path, monkeypatch, o_direct, fetch_workers, expected):
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
    from kvstore.store.tier_setup import build_tiers

    calls = []
    monkeypatch.setattr(read_probe, "_probe", probed({False: {3: 1.0}, True: {8: 2.0}}, calls))
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, prefault=False),
                      disk=DiskTierConfig(path=str(tmp_path / "d"), capacity_bytes=1 << 20, o_direct=o_direct,
                                          fetch_workers=fetch_workers))
    setups = build_tiers(cfg)
    try:
        disk = {s.tier.name: s for s in setups}["disk"]
        assert (disk.tier.o_direct, disk.fetch_workers) == expected
        assert calls == ([] if (o_direct, fetch_workers) == (False, 5) else [(False, True)] if o_direct == "auto" else [(False,)])
    finally:
        for s in setups:
            s.tier.close()


def test_an_answer_saved_by_an_older_probe_is_measured_again(tmp_path, monkeypatch):
    """The first probe counted its buffers' page faults as disk time, which favoured few reads
    in flight; the second measured buffered reads alone. Their saved answers are not kept."""
    for old in ({"inflight": {"false": 1}}, {"version": 2, "inflight": {"false": 1}}):
        monkeypatch.setattr(read_probe, "_measured", {})
        (tmp_path / RESULT_NAME).write_text(json.dumps(old))
        monkeypatch.setattr(read_probe, "_probe", probed({False: {8: 1.0}}))
        assert read_parallelism(str(tmp_path)) == 8
        monkeypatch.setattr(read_probe, "_measured", {})
        monkeypatch.setattr(read_probe, "_probe", probed({False: {3: 1.0}}))
        assert read_parallelism(str(tmp_path)) == 8  # saved now in this version: read back
