"""The disk tier's O_DIRECT writes (tiers/direct_write.py): any mix of aligned and unaligned
views lands byte for byte, the file is cut back to the value's length, nothing of it stays in
the page cache, and a file system that refuses O_DIRECT (tmpfs before Linux 6.6) gets
buffered writes."""

import errno
import mmap
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tiers.direct_write import ALIGN, BOUNCE_BYTES, bounce_buffer, write_direct
from tiers.disk import DiskTier
from tiers.read_probe import cached_bytes

POOL = np.frombuffer(mmap.mmap(-1, 8 << 20), dtype=np.uint8)
POOL[:] = np.random.default_rng(0).integers(0, 256, POOL.size, dtype=np.uint8)

# a view: (offset into the pool, length); offsets and lengths on and off the block
piece = st.tuples(st.one_of(st.integers(0, 16).map(lambda b: b * ALIGN), st.integers(0, 16 * ALIGN)),
                  st.one_of(st.integers(0, 64).map(lambda b: b * ALIGN), st.integers(0, 3 * BOUNCE_BYTES // 2)))


def views_of(pieces):
    return [memoryview(POOL[o : o + n]) for o, n in pieces]


def direct_fd(path):
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        pytest.skip(f"the file system under {path} refuses O_DIRECT")


def require_o_direct(directory):
    os.close(direct_fd(directory / "probe"))
    os.unlink(directory / "probe")


@settings(max_examples=60, deadline=None)
@given(st.lists(piece, max_size=6))
def test_any_views_land_byte_for_byte_and_nothing_stays_cached(tmp_path_factory, pieces):
    path = tmp_path_factory.mktemp("direct") / "value"
    views = views_of(pieces)
    fd = direct_fd(path)
    try:
        write_direct(fd, views, bounce_buffer())
    finally:
        os.close(fd)
    assert cached_bytes(str(path)) == 0  # before the read below brings it in
    assert path.stat().st_size == sum(len(v) for v in views)
    assert path.read_bytes() == b"".join(bytes(v) for v in views)


def test_a_tier_writes_its_copies_around_the_page_cache(tmp_path):
    require_o_direct(tmp_path)
    tier = DiskTier(tmp_path, 64 << 20, direct_writes=True)
    value = [memoryview(POOL[: 5 * ALIGN]), memoryview(POOL[5 * ALIGN : 5 * ALIGN + 1234])]
    tier.write(b"k" * 32, value)
    assert tier.direct_writes
    assert cached_bytes(str(tier.path_of(b"k" * 32))) == 0
    assert tier.read(b"k" * 32) == bytes(POOL[: 5 * ALIGN + 1234])
    assert tier.used_bytes == 6 * ALIGN


@pytest.mark.parametrize("refuses", ["open", "write"])
def test_a_file_system_that_refuses_o_direct_gets_buffered_writes(tmp_path, monkeypatch, refuses):
    import tiers.direct_write
    import tiers.disk

    real_open = os.open

    def no_direct_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    def no_direct_write(*args):
        raise OSError(errno.EINVAL, "Invalid argument")

    if refuses == "open":
        monkeypatch.setattr(tiers.disk.os, "open", no_direct_open)
    else:
        monkeypatch.setattr(tiers.direct_write.os, "pwritev", no_direct_write)
    tier = DiskTier(tmp_path, 1 << 20, direct_writes=True)
    tier.write(b"k" * 32, [memoryview(POOL[: ALIGN + 7])])
    assert not tier.direct_writes
    assert tier.read(b"k" * 32) == bytes(POOL[: ALIGN + 7])
    assert [p.name for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"] == [tier.path_of(b"k" * 32).name]


def test_the_store_config_turns_direct_writes_on(tmp_path):
    from helpers import store_config
    from kvstore.store import Store

    config = store_config(tmp_path)
    config.disk.direct_writes = True
    with Store(config) as store:
        assert store.tier("disk").direct_writes
    with Store(store_config(tmp_path / "default")) as store:
        assert not store.tier("disk").direct_writes
