"""Fixtures of the benchmark tests."""

import os

import pytest


@pytest.fixture
def cold_files(tmp_path):
    """Three 256 KiB files whose pages are dropped from the page cache (bench/limits.py's
    cold-read checks); skips where the file system keeps them cached."""
    from bench.limits import drop_cache

    paths = []
    for i in range(3):
        p = tmp_path / f"f{i}"
        p.write_bytes(os.urandom(256 << 10))
        paths.append(str(p))
    try:
        drop_cache(paths)
    except RuntimeError as exc:
        pytest.skip(f"this file system keeps pages cached: {exc}")
    return paths
