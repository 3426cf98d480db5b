"""``read_fully_hashing`` (tiers/files.py), the disk tier's verified read: the bytes land where
``read_fully`` puts them, the digest covers exactly what follows the header, and every read
starts at a multiple of the slice size (reads that started a header's length past each
boundary ran at half the speed once other reads had been through the page cache)."""

import os

import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from tiers.files import read_fully_hashing


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 5000), head=st.integers(0, 300), slice_bytes=st.integers(1, 1500),
       cuts=st.lists(st.integers(0, 5000), max_size=3), data=st.data())
def test_hashing_reads_land_every_byte_hash_the_payload_and_start_on_slice_boundaries(
        tmp_path_factory, size, head, slice_bytes, cuts, data):
    content = data.draw(st.binary(min_size=size, max_size=size))
    path = tmp_path_factory.mktemp("files") / "blob"
    path.write_bytes(content)
    room = size + data.draw(st.integers(0, 64))
    buf = bytearray(room)
    edges = sorted({0, room, *(c for c in cuts if c <= room)})
    outs = [memoryview(buf)[a:b] for a, b in zip(edges, edges[1:])]
    offsets = []
    preadv = os.preadv
    digest = xxhash.xxh3_64()
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(os, "preadv", lambda fd, views, offset: offsets.append(offset) or preadv(fd, views, offset))
            got = read_fully_hashing(fd, outs, head, digest, slice_bytes)
    finally:
        os.close(fd)
    assert got == size and bytes(buf[:size]) == content
    assert digest.intdigest() == xxhash.xxh3_64(content[head:]).intdigest()
    assert all(offset % slice_bytes == 0 for offset in offsets if offset < size)
