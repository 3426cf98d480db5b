"""The daemon's buffer pool: blobs of nearby sizes share buffers, and idle ones are capped."""

from kvstore.daemon.buffers import GRANULE, BufferPool


def test_nearby_sizes_reuse_one_buffer_and_idle_bytes_are_capped():
    pool = BufferPool(max_bytes=2 * GRANULE)
    a = pool.take(16_512)
    assert a.nbytes == 16_512
    pool.give(a)
    b = pool.take(9_000)  # an lz4 blob of another size: the same buffer
    assert b.nbytes == 9_000 and b.base is a.base
    c, d, e = pool.take(100), pool.take(100), pool.take(100)
    for buf in (b, c, d, e):
        pool.give(buf)
    assert pool._idle_bytes == 2 * GRANULE  # the rest went back to the allocator
