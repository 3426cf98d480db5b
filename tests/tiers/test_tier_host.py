import os
import random
import threading

import numpy as np
import pytest
import torch

from tiers.base import TierFull, TierUnavailable
from tiers.host import HostTier

PAGE = 4096


def blob(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_write_read_round_trip_in_pieces():
    tier = HostTier(16 * PAGE, page_bytes=PAGE)
    data = blob(3 * PAGE + 17, 1)
    tier.write(b"k", [data[:10], memoryview(data)[10:5000], np.frombuffer(data[5000:], np.uint8)])
    assert tier.read(b"k") == data
    out1, out2 = bytearray(100), bytearray(len(data) - 100)
    assert tier.read_into(b"k", [out1, out2]) == len(data)
    assert bytes(out1 + out2) == data
    assert tier.size_of(b"k") == len(data)
    assert tier.used_bytes == 4 * PAGE
    with pytest.raises(ValueError):
        tier.read_into(b"k", bytearray(10))
    assert tier.read(b"missing") is None and tier.read_into(b"missing", bytearray(1)) is None


def test_a_read_on_the_main_thread_copies_on_torchs_team(monkeypatch):
    """A Store's get from host RAM, on an engine's thread, copies on that thread's OpenMP
    team, whose threads spin between copies, not on the copy threads, which sleep."""
    from kernels import parallel_copy

    tier = HostTier(64 * PAGE, page_bytes=PAGE)
    data = blob(parallel_copy.TEAM_MIN_BYTES + 3 * PAGE + 5, 3)
    tier.write(b"k", [data])
    handed = []
    monkeypatch.setattr(parallel_copy, "_run_tasks", handed.append)
    monkeypatch.setattr(parallel_copy, "PARALLEL_MIN_BYTES", 1)
    monkeypatch.setattr(parallel_copy, "_workers", 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(parallel_copy, "_team_off_until", 0.0)  # no earlier test's slow copy counts
    out = bytearray(len(data))
    assert tier.read_into(b"k", out) == len(data)
    assert bytes(out) == data and handed == []
    tier.close()


def test_full_tier_raises_and_delete_gives_space_back():
    tier = HostTier(4 * PAGE, page_bytes=PAGE)
    tier.write(b"a", [blob(3 * PAGE, 1)])
    with pytest.raises(TierFull):
        tier.write(b"b", [blob(2 * PAGE, 2)])
    assert tier.delete(b"a") and not tier.delete(b"a")
    tier.write(b"b", [blob(4 * PAGE, 2)])
    assert tier.used_bytes == 4 * PAGE == tier.capacity_bytes


def test_replace_keeps_capacity_exact():
    tier = HostTier(8 * PAGE, page_bytes=PAGE)
    for i in range(50):
        tier.write(b"k", [blob(random.Random(i).randint(1, 8 * PAGE - 1) // 2, i)])
    assert len(tier) == 1
    assert tier.used_bytes == tier.footprint(tier.size_of(b"k"))


def test_pinned_view_survives_delete_and_reuse():
    tier = HostTier(2 * PAGE, page_bytes=PAGE)
    data = blob(2 * PAGE, 3)
    tier.write(b"a", [data])
    with tier.pinned(b"a") as views:
        tier.delete(b"a")
        with pytest.raises(TierFull):  # pages still belong to the pinned value
            tier.write(b"b", [blob(PAGE, 4)])
        assert b"".join(views) == data
    tier.write(b"b", [blob(2 * PAGE, 4)])


def test_random_storm_never_exceeds_capacity():
    rng = random.Random(7)
    tier = HostTier(32 * PAGE, page_bytes=PAGE)
    model: dict[bytes, bytes] = {}
    for step in range(2000):
        key = bytes([rng.randrange(20)])
        op = rng.random()
        if op < 0.5:
            data = blob(rng.randint(1, 6 * PAGE), step)
            try:
                tier.write(key, [data])
                model[key] = data
            except TierFull:
                pass
        elif op < 0.8:
            assert tier.read(key) == model.get(key)
        else:
            assert tier.delete(key) == (model.pop(key, None) is not None)
        assert tier.used_bytes <= tier.capacity_bytes
        assert tier.used_bytes == sum(tier.footprint(len(v)) for v in model.values())


def test_concurrent_writers_and_readers():
    tier = HostTier(64 * PAGE, page_bytes=PAGE)
    errors = []

    def worker(wid):
        rng = random.Random(wid)
        for i in range(300):
            key = bytes([wid, rng.randrange(4)])
            data = bytes([wid, i % 256]) * rng.randint(1, 2 * PAGE)
            try:
                tier.write(key, [data])
            except TierFull:
                continue
            got = tier.read(key)
            # another thread never writes this worker's keys, so the value is ours or newer of ours
            if got is not None and got[:1] != bytes([wid]):
                errors.append((wid, got[:2]))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert tier.used_bytes <= tier.capacity_bytes


def test_shared_memory_pool_is_visible_to_another_mapping(tmp_path):
    import mmap

    path = "/dev/shm/kvstore-test-pool" if __import__("os").path.isdir("/dev/shm") else str(tmp_path / "pool")
    tier = HostTier(4 * PAGE, page_bytes=PAGE, shm_path=path)
    try:
        tier.write(b"k", [b"hello shared world"])
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as other:
            assert b"hello shared world" in other[:]
    finally:
        tier.close()


def test_bad_construction():
    with pytest.raises(ValueError):
        HostTier(PAGE, page_bytes=1000)
    with pytest.raises(ValueError):
        HostTier(PAGE - 1, page_bytes=PAGE)
    with pytest.raises(ValueError):
        HostTier(0)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("payload_bytes", [(1 << 20) + 77, (5 << 20) + 77])
def test_write_sealed_hashes_the_payload_as_it_lands_and_writes_the_head_last(payload_bytes, version):
    """Pages of 4 KiB and slices of 256 KiB: the head and payload straddle page runs, and the
    digest the head is sealed with is that of the whole payload (5 MiB, version 2: its leaves
    are copied and hashed on the copy threads)."""
    from kvstore.blob import payload_checksum, payload_digest

    tier = HostTier(12 << 20, page_bytes=4096)
    tier.write(b"other", [b"x" * 5000])  # so the value's pages are not one run from page 0
    payload = np.random.default_rng(3).integers(0, 256, payload_bytes, dtype=np.uint8)
    digest = payload_digest(version)

    def seal():
        return digest.intdigest().to_bytes(8, "little") * 16

    tier.write_sealed(b"k", 128, payload, digest, seal)
    value = tier.read(b"k")
    assert value[128:] == payload.tobytes()
    assert value[:128] == payload_checksum(payload.tobytes(), version).to_bytes(8, "little") * 16
    with pytest.raises(ValueError, match="seal"):
        tier.write_sealed(b"j", 64, payload, payload_digest(version), seal)


def test_a_write_sealed_whose_seal_refuses_the_payload_stores_nothing_and_keeps_no_pages():
    """The Store's check of a client's payload (``ClaimedBlob``) raises from ``seal()``: the
    pages the copy took went unreturned, and a client sending damaged blobs filled host RAM."""
    from kvstore.blob import payload_digest

    tier = HostTier(1 << 20, page_bytes=4096)
    payload = np.arange(10_000, dtype=np.uint8)

    def refuse():
        raise ValueError("payload checksum mismatch")

    for _ in range(2 * tier.capacity_bytes // 12_288):
        with pytest.raises(ValueError, match="checksum"):
            tier.write_sealed(b"k", 128, payload, payload_digest(), refuse)
    assert tier.used_bytes == 0 and tier.read(b"k") is None
    tier.write(b"k", [b"h" * 128, payload])  # the room is all there


def test_a_second_tier_on_a_live_pool_file_is_refused_and_wipes_nothing(tmp_path):
    """A host pool in a file had no owner: the tier opened it with O_TRUNC, so a second
    in-process store given the same ``shm_path`` zeroed the first one's chunks under it, and
    both then handed out the same pages. Now the file is locked before it is truncated."""
    path = str(tmp_path / "pool")
    first = HostTier(4 * PAGE, page_bytes=PAGE, shm_path=path)
    try:
        first.write(b"k", [b"the first store's chunk"])
        with pytest.raises(TierUnavailable, match="another live store"):
            HostTier(4 * PAGE, page_bytes=PAGE, shm_path=path)
        assert first.read(b"k") == b"the first store's chunk"
    finally:
        first.close()
    again = HostTier(4 * PAGE, page_bytes=PAGE, shm_path=path)  # the owner closed: the file is free
    again.close()
    assert not os.path.exists(path)


def test_a_pool_file_replaced_under_a_tier_is_not_unlinked_by_it(tmp_path):
    """Closing unlinks the pool file only while the path still names the file the tier locked."""
    path = str(tmp_path / "pool")
    tier = HostTier(4 * PAGE, page_bytes=PAGE, shm_path=path)
    os.unlink(path)
    newer = HostTier(4 * PAGE, page_bytes=PAGE, shm_path=path)
    try:
        tier.close()
        assert os.path.exists(path), "closing the old tier removed the newer tier's pool file"
    finally:
        newer.close()


@pytest.mark.parametrize("shared", [False, True], ids=["private", "shm-file"])
def test_the_pool_registers_with_cuda_once_where_there_is_cuda(tmp_path, shared):
    # CUDA page-locks a shared mapping of tmpfs (the daemon's /dev/shm pools), not of a disk file
    if shared and not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    tier = HostTier(1 << 20, page_bytes=4096, shm_path=f"/dev/shm/kvstore-test-{os.getpid()}" if shared else None)
    tier.write(b"k", [b"\x07" * 10_000])
    with tier.pinned(b"k") as views:
        src = torch.frombuffer(views[0], dtype=torch.uint8)
        if not torch.cuda.is_available():
            assert not tier.register_with_cuda()
        else:
            assert not src.is_pinned()
            assert tier.register_with_cuda() and tier.register_with_cuda()
            assert src.is_pinned()
            assert torch.equal(src.to("cuda", non_blocking=True).cpu(), src)
        del src
    tier.close()
    assert not tier.register_with_cuda()  # a closed pool is never registered


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_pool_cuda_refuses_leaves_no_error_behind_for_the_next_kernel(tmp_path):
    """CUDA page-locks no shared mapping of a disk file. Before the fix the refusal stayed the
    thread's pending CUDA error, and the next torch kernel launched on the thread failed with it."""
    tier = HostTier(1 << 20, page_bytes=4096, shm_path=str(tmp_path / "pool"))
    try:
        assert not tier.register_with_cuda()
        x = torch.arange(6, device="cuda").reshape(2, 3).t()
        assert x.contiguous().cpu().tolist() == [[0, 3], [1, 4], [2, 5]]  # a copy kernel launch
    finally:
        tier.close()
