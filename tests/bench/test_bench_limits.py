"""bench/limits.py: each limit is the best of the configurations it tried, named; the
cold-read check really sees a cached file."""

import os

import numpy as np
import pytest

from bench import limits
from tiers import read_probe
from bench.limits import Limit, best_of, best_over, cached_bytes, disk_read_limit, drop_cache, memcpy_limit, over_limit, socket_limit


def _is_best(limit: Limit) -> None:
    assert limit.gbps == max(limit.tried.values())
    assert limit.tried[limit.config] == limit.gbps
    assert all(v > 0 for v in limit.tried.values())


def test_best_of_names_the_configuration_that_gave_the_maximum():
    limit = best_of({"a": 1.0, "b": 3.0, "c": 2.0})
    assert (limit.gbps, limit.config) == (3.0, "b")
    with pytest.raises(ValueError):
        best_of({})


def test_over_limit_flags_only_figures_beyond_noise():
    limit = Limit(10.0, "x")
    assert over_limit({"ok": 10.4, "low": 3.0}, limit) == []
    assert len(over_limit({"bad": 10.6}, limit)) == 1


def test_memcpy_limit_is_the_best_of_numpy_threads_and_torch():
    pairs = [(np.zeros(1 << 20, np.uint8), np.full(1 << 20, i, np.uint8)) for i in range(3)]
    limit = memcpy_limit(pairs, repeat=1)
    _is_best(limit)
    names = " | ".join(limit.tried)
    assert "np.copyto, 1 thread" in names and "torch copy_" in names and "memmove over slices, 2 threads" in names
    assert all(np.array_equal(d, s) for d, s in pairs)  # every configuration really copied


def test_memcpy_limit_reports_whichever_config_is_fastest(monkeypatch):
    """The selection follows the measurements, not a fixed favourite."""
    times = iter([3.0, 1.0] + [2.0] * 20)  # the second config measured is the fastest
    monkeypatch.setattr(limits, "best_time", lambda fn, repeat: next(times))
    limit = memcpy_limit([(np.zeros(4096, np.uint8), np.ones(4096, np.uint8))], repeat=1)
    assert limit.config == list(limit.tried)[1]
    _is_best(limit)


def test_best_time_runs_the_call_as_often_as_asked_and_keeps_the_shortest(monkeypatch):
    clock = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])  # timings of 5, 1 and 3 s
    monkeypatch.setattr(limits.time, "perf_counter", lambda: next(clock))
    calls = []
    assert limits.best_time(lambda: calls.append(1), 3) == 1.0
    assert len(calls) == 3


def test_cached_bytes_sees_a_cached_file_and_its_drop(cold_files):
    path = cold_files[0]
    with open(path, "rb") as f:
        f.read()
    assert cached_bytes(path) == os.path.getsize(path)
    drop_cache([path])
    assert cached_bytes(path) == 0


def test_drop_cache_fails_when_pages_stay(cold_files, monkeypatch):
    monkeypatch.setattr(read_probe, "cached_bytes", lambda p: 4096)
    with pytest.raises(RuntimeError, match="page cache"):
        drop_cache(cold_files)


def test_disk_limit_is_the_best_of_modes_and_reads_in_flight(cold_files, monkeypatch):
    seen = []
    real = limits.read_all

    def read_all(paths, n, direct, read_bytes=None, buffers=None):
        assert all(cached_bytes(p) == 0 for p in paths)  # every run starts cold
        seen.append((n, direct))
        real(paths, n, direct, read_bytes, buffers)

    monkeypatch.setattr(limits, "read_all", read_all)
    limit = disk_read_limit(cold_files)
    _is_best(limit)
    assert {n for n, _ in seen} == set(limits.INFLIGHT)
    assert "buffered, 8 in flight" in limit.tried and "buffered in 256 KiB reads, 1 in flight" in limit.tried


def test_socket_limit_is_the_best_of_its_streams():
    limit = socket_limit(64 << 10, 0.05, sources=3, destinations=2, streams=(1, 2))
    _is_best(limit)
    assert set(limit.tried) == {"1 stream", "2 streams"}


def test_socket_streams_share_out_the_sources_and_destinations(monkeypatch):
    """Each stream sends out of its share of the distinct chunks and receives into its share
    of the buffers, so the limit is as cold in cache as the get it bounds."""
    made, real_full = [], np.full

    def full(shape, fill, dtype):
        made.append(fill)
        return real_full(shape, fill, dtype=dtype)

    monkeypatch.setattr(limits.np, "full", full)
    moved = limits.socket_gbps(64 << 10, 0.05, 2, sources=16, destinations=8)
    assert moved > 0
    assert sorted(made) == [0] * 8 + [1] * 16


def test_best_over_keeps_each_configurations_best_moment():
    early = Limit(3.0, "a", {"a": 3.0, "b": 1.0})
    late = Limit(2.5, "b", {"a": 0.5, "b": 2.5, "c": 2.0})
    limit = best_over([early, late])
    assert limit.tried == {"a": 3.0, "b": 2.5, "c": 2.0}
    assert (limit.gbps, limit.config) == (3.0, "a")
    _is_best(limit)
