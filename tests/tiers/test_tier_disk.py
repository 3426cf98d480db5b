import os
import random
import threading

import numpy as np
import pytest

from fsfaults import remount_read_only, tiny_tmpfs
from tiers.base import TierFull, TierUnavailable
from tiers.files import SUFFIX
from tiers.disk import DataDirectoryInUse, DiskTier


def blob(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def test_round_trip_scatter_read(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    data = blob(10_000, 1)
    tier.write(key(1), [data[:128], memoryview(data)[128:]])
    head, rest = bytearray(128), bytearray(len(data) - 128)
    assert tier.read_into(key(1), [head, rest]) == len(data)
    assert bytes(head + rest) == data
    assert tier.read(key(1)) == data
    assert tier.used_bytes == 12288  # rounded up to 4 KiB blocks
    path = tier.path_of(key(1))
    assert path.exists() and path.parent.parent.parent == tmp_path


def test_o_direct_reads_match(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20, o_direct=True)
    data = blob(9_999, 2)
    tier.write(key(2), [data])
    out = bytearray(len(data))
    assert tier.read_into(key(2), memoryview(out)) == len(data)
    assert bytes(out) == data


def test_restart_rebuilds_index_and_drops_temp_files(tmp_path):
    tier = DiskTier(tmp_path, 1 << 20)
    for i in range(5):
        tier.write(key(i), [blob(5000 + i, i)])
    stray = tier.path_of(key(9)).with_name("half-written.123.tmp")
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"partial")
    tier.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert sorted(again.keys()) == [key(i) for i in range(5)]
    assert again.read(key(3)) == blob(5003, 3)
    assert again.used_bytes == 5 * 8192
    assert not stray.exists()


def test_capacity_is_never_exceeded_and_delete_gives_space_back(tmp_path):
    tier = DiskTier(tmp_path, 10 * 4096)
    rng = random.Random(1)
    present = {}
    for step in range(400):
        k = key(rng.randrange(12))
        if rng.random() < 0.6:
            n = rng.randint(1, 3 * 4096)
            try:
                tier.write(k, [blob(n, step)])
                present[k] = n
            except TierFull:
                pass
        else:
            assert tier.delete(k) == (present.pop(k, None) is not None)
        assert tier.used_bytes <= tier.capacity_bytes
        assert tier.used_bytes == sum(-(-n // 4096) * 4096 for n in present.values())
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path) for f in fs if f.endswith(SUFFIX))
    assert on_disk == sum(present.values())


def test_missing_directory_is_recreated(tmp_path):
    root = tmp_path / "data"
    tier = DiskTier(root, 1 << 20)
    tier.write(key(1), [b"x" * 100])
    import shutil

    shutil.rmtree(root)
    assert tier.read(key(1)) is None  # vanished: a clean miss, and forgotten
    assert not tier.contains(key(1))
    tier.write(key(2), [b"y" * 100])
    assert tier.read(key(2)) == b"y" * 100


def test_unusable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(TierUnavailable, match="cannot use data directory"):
        DiskTier(blocker / "data", 1 << 20)


def test_full_file_system_raises_tier_full_and_leaves_nothing_behind(tmp_path):
    with tiny_tmpfs(tmp_path / "mnt", 64 * 1024) as mnt:
        tier = DiskTier(mnt, 1 << 30)  # capacity larger than the device
        tier.write(key(1), [blob(20_000, 1)])
        with pytest.raises(TierFull, match="full"):
            tier.write(key(2), [blob(100_000, 2)])
        assert not tier.contains(key(2))
        assert [f for _, _, fs in os.walk(mnt) for f in fs if f.endswith(".tmp")] == []
        assert tier.read(key(1)) == blob(20_000, 1)
        assert tier.used_bytes == 20480


def test_read_only_file_system_raises_unavailable_and_still_serves(tmp_path):
    with tiny_tmpfs(tmp_path / "mnt", 1 << 20) as mnt:
        tier = DiskTier(mnt, 1 << 20)
        tier.write(key(1), [b"a" * 5000])
        remount_read_only(mnt)
        with pytest.raises(TierUnavailable):
            tier.write(key(2), [b"b" * 5000])
        assert tier.read(key(1)) == b"a" * 5000
        assert tier.used_bytes == 8192


def test_parallel_reads(tmp_path):
    tier = DiskTier(tmp_path, 1 << 22, read_threads=4)
    for i in range(16):
        tier.write(key(i), [blob(50_000, i)])
    outs = [bytearray(50_000) for _ in range(16)]
    assert tier.read_many_into([key(i) for i in range(16)], outs) == [50_000] * 16
    assert all(bytes(o) == blob(50_000, i) for i, o in enumerate(outs))


def test_concurrent_writers(tmp_path):
    tier = DiskTier(tmp_path, 1 << 22)

    def worker(w):
        for i in range(30):
            tier.write(key(w * 100 + i % 5), [bytes([w]) * 3000])

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(tier) == 20 and tier.used_bytes == 20 * 4096
    for k in tier.keys():
        w = int.from_bytes(k, "big") // 100
        assert tier.read(k) == bytes([w]) * 3000


def test_a_second_process_on_a_data_directory_is_refused_until_the_first_is_gone(tmp_path):
    first = DiskTier(tmp_path, 1 << 20)
    first.write(key(1), [blob(5000, 1)])
    with pytest.raises(DataDirectoryInUse, match=f"pid {os.getpid()}"):
        DiskTier(tmp_path, 1 << 20)
    assert first.read(key(1)) == blob(5000, 1)  # the refused one touched nothing
    first.close()
    again = DiskTier(tmp_path, 1 << 20)
    assert again.read(key(1)) == blob(5000, 1)
    again.close()


def test_a_dead_holder_leaves_no_stale_lock(tmp_path):
    import subprocess
    import sys

    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from tiers.disk import DiskTier; DiskTier(sys.argv[1], 1 << 20); "
         "print('held', flush=True); time.sleep(60)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DataDirectoryInUse, match=f"pid {holder.pid}"):
            DiskTier(tmp_path, 1 << 20)
    finally:
        holder.kill()
        holder.wait()
    DiskTier(tmp_path, 1 << 20).close()


def test_21_a_delete_racing_a_rewrite_of_the_same_key_never_unlinks_the_new_file(tmp_path, monkeypatch):
    """The delete stops just before its unlink while a write of the same key runs: the tier
    must end with the new value both in its books and on disk (the old code unlinked it)."""
    tier = DiskTier(tmp_path, 1 << 20)
    tier.write(key(1), [blob(5000, 1)])
    path = str(tier.path_of(key(1)))
    entered, release = threading.Event(), threading.Event()
    unlink = os.unlink

    def held_unlink(p, *a, **kw):
        if str(p) == path and not release.is_set():
            entered.set()
            release.wait()
        return unlink(p, *a, **kw)

    monkeypatch.setattr(os, "unlink", held_unlink)
    deleter = threading.Thread(target=tier.delete, args=(key(1),))
    deleter.start()
    assert entered.wait(10)
    writer = threading.Thread(target=tier.write, args=(key(1), [blob(6000, 2)]))
    writer.start()
    writer.join(0.5)  # the old code renamed the new file into place here, for the unlink to remove
    release.set()
    deleter.join()
    writer.join()
    assert tier.contains(key(1)) and tier.read(key(1)) == blob(6000, 2)


@pytest.mark.parametrize("version", [1, 2])
@pytest.mark.parametrize("o_direct", [False, True])
def test_read_into_hashing_digests_exactly_the_bytes_past_the_head(tmp_path, o_direct, version):
    """Buffered reads hash slice by slice as they land (slices smaller than the value here),
    O_DIRECT ones as they are copied out (a tree digest's leaves on the copy threads): either
    way the digest is of every byte past the head."""
    from kvstore.blob import payload_checksum, payload_digest
    from tiers import disk

    tier = DiskTier(tmp_path / "d", 16 << 20, o_direct=o_direct)
    value = os.urandom(18 * disk.HASH_SLICE_BYTES + 1000)  # over PARALLEL_MIN_BYTES
    tier.write(b"k", [value])
    head, body = bytearray(128), bytearray(len(value) - 128)
    digest = payload_digest(version)
    assert tier.read_into_hashing(b"k", [head, body], 128, digest) == len(value)
    assert bytes(head) + bytes(body) == value
    assert digest.intdigest() == payload_checksum(value[128:], version)
    assert tier.read_into_hashing(b"absent", [head, body], 128, payload_digest(version)) is None
    tier.close()


def test_a_synced_value_in_a_new_fan_out_directory_has_that_directory_synced_into_its_parent(tmp_path, monkeypatch):
    """Suspected in issue 36, confirmed: a value's first write into a fan-out directory created
    the directory (two levels) and ``sync`` fsynced the file and its own directory only, never
    the directories the new ones were entered in. A power loss could then lose the new
    directory's entry, and with it the durable put's file. Every directory a write creates
    must be synced into its parent before ``sync`` returns."""
    tier = DiskTier(tmp_path / "data", 1 << 20)
    created, synced = [], []
    real_mkdir, real_fsync = os.mkdir, os.fsync

    def mkdir(path, *a, **kw):
        real_mkdir(path, *a, **kw)
        created.append(os.path.realpath(path))

    def fsync(fd):
        real_fsync(fd)
        synced.append((os.path.realpath(os.readlink(f"/proc/self/fd/{fd}")), len(created)))

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "fsync", fsync)
    key = bytes(range(32))
    tier.write(key, [np.arange(1000, dtype=np.uint8)])
    tier.sync(key)
    assert created, "the write created no fan-out directory"
    for i, directory in enumerate(created):
        parent = os.path.dirname(directory)
        assert any(path == parent and after > i for path, after in synced), (
            f"{directory} was created and its parent {parent} never synced after it")
