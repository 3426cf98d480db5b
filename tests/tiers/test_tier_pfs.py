import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.base import TierFull
from tiers.pfs import PfsTier


def blob(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def files(root, suffix):
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(suffix)]


def test_a_daemon_finds_and_reads_what_another_wrote_after_it_started(tmp_path):
    a = PfsTier(tmp_path, 1 << 22)
    b = PfsTier(tmp_path, 1 << 22)  # started before anything was written
    data = blob(50_000, 1)
    a.write(key(1), [data[:64], memoryview(data)[64:]])
    assert b.size_of(key(1)) == len(data) and b.contains(key(1))
    head, rest = bytearray(64), bytearray(len(data) - 64)
    assert b.read_into(key(2), [head, rest]) is None
    assert b.read_into(key(1), [head, rest]) == len(data)
    assert bytes(head + rest) == data
    a.write(key(3), [b"three" * 1000])
    assert b.read(key(3)) == b"three" * 1000  # read without asking contains first
    a.write(key(4), [b"four"])
    assert sorted(b.keys()) == [key(1), key(3), key(4)]
    assert b.used_bytes == a.used_bytes == 53248 + 8192 + 4096


def test_delete_by_one_daemon_is_a_clean_miss_for_another(tmp_path):
    a = PfsTier(tmp_path, 1 << 20)
    a.write(key(1), [b"x" * 10_000])
    b = PfsTier(tmp_path, 1 << 20)
    assert b.contains(key(1)) and b.used_bytes == 12288
    assert a.delete(key(1))
    assert b.read_into(key(1), bytearray(10_000)) is None
    assert not b.contains(key(1)) and b.used_bytes == 0
    assert b.read(key(1)) is None
    assert not b.delete(key(1))


def test_concurrent_writers_of_one_key_and_a_reader(tmp_path):
    daemons = [PfsTier(tmp_path, 1 << 24) for _ in range(3)]
    data = blob(300_000, 7)
    stop = threading.Event()
    seen = []

    def reader():
        out = bytearray(len(data))
        while not stop.is_set():
            got = daemons[0].read_into(key(5), out)
            seen.append(got)
            if got is not None:
                assert got == len(data) and bytes(out) == data  # never a partial file

    def writer(tier):
        for _ in range(15):
            tier.write(key(5), [data])

    r = threading.Thread(target=reader)
    r.start()
    writers = [threading.Thread(target=writer, args=(t,)) for t in daemons]
    [w.start() for w in writers]
    [w.join() for w in writers]
    stop.set()
    r.join()
    assert files(tmp_path, ".tmp") == [] and len(files(tmp_path, ".kvb")) == 1
    assert daemons[2].read(key(5)) == data and seen


def test_stale_temp_files_are_removed_but_fresh_ones_belong_to_writers_in_flight(tmp_path):
    a = PfsTier(tmp_path, 1 << 20)
    a.write(key(1), [b"done" * 100])
    final = a.path_of(key(2))
    final.parent.mkdir(parents=True, exist_ok=True)
    crashed = a.temp_path(final)
    crashed.write_bytes(b"half")
    old = time.time() - 7200
    os.utime(crashed, (old, old))
    in_flight = final.with_name(final.name + ".otherhost.123.abcdef.tmp")
    in_flight.write_bytes(b"still being written")
    b = PfsTier(tmp_path, 1 << 20, stale_temp_s=3600)
    assert not crashed.exists() and in_flight.exists()
    assert list(b.keys()) == [key(1)] and b.read(key(2)) is None
    assert b.used_bytes == 4096


def test_temp_names_are_unique_across_hosts_and_processes(tmp_path):
    tier = PfsTier(tmp_path, 1 << 20)
    final = tier.path_of(key(1))
    names = {tier.temp_path(final).name for _ in range(100)}
    assert len(names) == 100
    host = socket.gethostname().replace(".", "-")
    assert all(f".{host}.{os.getpid()}." in n and n.endswith(".tmp") for n in names)


def test_truncated_file_reads_its_real_length(tmp_path):
    tier = PfsTier(tmp_path, 1 << 20)
    data = blob(10_000, 3)
    tier.write(key(1), [data])
    os.truncate(tier.path_of(key(1)), 4000)
    out = bytearray(10_000)
    assert tier.read_into(key(1), out) == 4000
    assert bytes(out[:4000]) == data[:4000]
    with pytest.raises(ValueError, match="too small"):
        tier.read_into(key(1), bytearray(100))


def test_capacity_is_this_daemons_view_and_rescan_refreshes_it(tmp_path):
    a = PfsTier(tmp_path, 5 * 4096)
    b = PfsTier(tmp_path, 5 * 4096)
    for i in range(4):
        a.write(key(i), [b"a" * 4096])
    assert b.used_bytes == 0
    b.write(key(10), [b"b" * 4096])  # b's view does not yet hold a's files
    b.rescan()
    assert b.used_bytes == 5 * 4096
    with pytest.raises(TierFull):
        b.write(key(11), [b"b" * 10])
    assert not b.contains(key(11))


def test_parallel_reads_and_device_read_on_cpu(tmp_path):
    a = PfsTier(tmp_path, 1 << 23, read_threads=4)
    for i in range(16):
        a.write(key(i), [blob(100_000, i)])
    b = PfsTier(tmp_path, 1 << 23, read_threads=4)
    outs = [bytearray(100_000) for _ in range(17)]
    got = b.read_many_into([key(i) for i in range(17)], outs)
    assert got == [100_000] * 16 + [None]
    assert all(bytes(outs[i]) == blob(100_000, i) for i in range(16))
    t = torch.zeros(25_000, dtype=torch.float32)
    assert b.read_into_device(key(3), t) == 100_000
    assert t.numpy().tobytes() == blob(100_000, 3)
    assert b.read_into_device(key(99), t) is None



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("gpu_direct", [True, False], ids=["kvikio", "through-host"])
def test_device_read_into_a_cuda_tensor(tmp_path, monkeypatch, gpu_direct):
    import tiers.pfs

    if gpu_direct and tiers.pfs.kvikio is None:
        pytest.skip("kvikio is not installed")
    if not gpu_direct:
        monkeypatch.setattr(tiers.pfs, "kvikio", None)
    tier = PfsTier(tmp_path, 1 << 23)
    tier.write(key(3), [blob(100_000, 3)])
    out = torch.zeros(25_001, dtype=torch.float32, device="cuda")
    assert tier.read_into_device(key(3), out) == 100_000
    assert out[:25_000].cpu().numpy().tobytes() == blob(100_000, 3)
    assert out[25_000].item() == 0  # nothing past the value's bytes is written
    assert tier.read_into_device(key(99), out) is None
    with pytest.raises(ValueError, match="too small"):
        tier.read_into_device(key(3), torch.zeros(100, dtype=torch.float32, device="cuda"))


WRITER = """
import sys
import numpy as np
from tiers.pfs import PfsTier
tier = PfsTier(sys.argv[1], 1 << 24)
data = np.random.default_rng(11).integers(0, 256, 200_000, dtype=np.uint8).tobytes()
for _ in range(20):
    tier.write((5).to_bytes(32, "big"), [data])
"""


def test_writer_processes_and_a_reader_process_share_the_mount(tmp_path):
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], cwd=repo) for _ in range(2)]
    reader = PfsTier(tmp_path, 1 << 24)
    out = bytearray(200_000)
    while any(p.poll() is None for p in procs):
        got = reader.read_into(key(5), out)
        assert got is None or (got == 200_000 and bytes(out) == blob(200_000, 11))
    assert [p.wait() for p in procs] == [0, 0]
    assert reader.read(key(5)) == blob(200_000, 11)
    assert files(tmp_path, ".tmp") == []


def test_a_second_store_on_the_mount_serves_what_the_first_stored(tmp_path):
    ns = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=8)
    keys = chunk_keys(list(range(5 * ns.chunk_tokens)), ns)
    values = [torch.randn(ns.chunk_shape).to(torch.float16) for _ in keys]
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False),
                         disk=DiskTierConfig(enabled=False))
    with Store(config, extra_tiers=[PfsTier(tmp_path / "pfs", 1 << 20)]) as first:
        for k, v in zip(keys, values):
            first.put(k, v, durable=True)
        truncated = first.tiers[1].path_of(keys[4].id)
    os.truncate(truncated, 100)
    with Store(config, extra_tiers=[PfsTier(tmp_path / "pfs", 1 << 20)]) as second:
        assert second.lookup(keys) == 5  # recovered from a scan of the mount
        got = second.get(keys)
        assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, values))
        assert second.stats().tiers["pfs"].corruptions == 1
    assert not truncated.exists()  # deleted in the background; closing the Store waits for that


def test_18_a_bandwidth_cap_keeps_the_pfs_tier_shared(tmp_path):
    from tiers.throttle import ThrottledTier

    capped = ThrottledTier(PfsTier(tmp_path, 1 << 20), 100e6)
    assert capped.shared is True  # discovery, shared-index updates and the no-recode rule depend on it


def test_a_read_racing_a_delete_does_not_count_the_deleted_file_again(tmp_path, monkeypatch):
    """A read learns the file's length after reading it, outside the key's stripe. Before the
    fix it recorded that length even when a delete of ours had removed the file meanwhile: the
    view then counted a file that did not exist, whose bytes held the budget (and refused
    writes into an empty tier) until a rescan."""
    import tiers.pfs as pfs_module

    bytes_in, let_go = threading.Event(), threading.Event()
    read_fully = pfs_module.read_fully

    def held_read_fully(fd, outs):
        got = read_fully(fd, outs)
        bytes_in.set()
        assert let_go.wait(10)
        return got

    monkeypatch.setattr(pfs_module, "read_fully", held_read_fully)
    tier = PfsTier(tmp_path, 4096)  # room for one value
    data = blob(3000, 7)
    tier.write(key(1), [data])
    out = bytearray(len(data))
    got = []
    reader = threading.Thread(target=lambda: got.append(tier.read_into(key(1), [out])))
    reader.start()
    assert bytes_in.wait(10)
    assert tier.delete(key(1)) and tier.used_bytes == 0
    let_go.set()
    reader.join(10)
    assert got == [len(data)] and bytes(out) == data  # the read had the whole file
    assert tier.used_bytes == 0 and tier.size_of(key(1)) is None
    tier.write(key(2), [data])  # the empty tier has room for it
