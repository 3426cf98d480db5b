import random
import threading

import numpy as np
import pytest
import torch

from tiers.base import TierFull, TierUnavailable
from tiers.gpu import GpuTier

PAGE = 4096
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def blob(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_no_cuda_is_a_clear_error():
    with pytest.raises(TierUnavailable, match="no CUDA device"):
        GpuTier(1 << 20)


def test_rejects_other_devices_and_bad_sizes():
    with pytest.raises(ValueError, match="CUDA device"):
        GpuTier(1 << 20, device="meta")
    with pytest.raises(ValueError, match="smaller than one page"):
        GpuTier(100, page_bytes=PAGE, device="cpu")


# The page accounting and copies, on CPU memory (device="cpu" exists for these tests only).


def test_round_trip_in_pieces_and_page_accounting():
    tier = GpuTier(16 * PAGE, page_bytes=PAGE, device="cpu")
    data = blob(3 * PAGE + 17, 1)
    tier.write(b"k", [data[:10], memoryview(data)[10:5000], torch.frombuffer(bytearray(data[5000:]), dtype=torch.uint8)])
    assert tier.read(b"k") == data
    out1, out2 = bytearray(100), bytearray(len(data) - 100 + 50)
    assert tier.read_into(b"k", [out1, memoryview(out2)]) == len(data)
    assert bytes(out1 + out2[: len(data) - 100]) == data
    assert tier.size_of(b"k") == len(data) and tier.contains(b"k")
    assert tier.used_bytes == 4 * PAGE and tier.footprint(len(data)) == 4 * PAGE
    with pytest.raises(ValueError, match="too small"):
        tier.read_into(b"k", bytearray(10))
    assert tier.read(b"missing") is None and tier.read_into(b"missing", bytearray(1)) is None
    tier.write(b"k", [b""])
    assert tier.read(b"k") == b"" and tier.used_bytes == PAGE
    assert tier.delete(b"k") and not tier.delete(b"k") and tier.used_bytes == 0


def test_tensor_parts_and_device_reads():
    tier = GpuTier(8 * PAGE, page_bytes=PAGE, device="cpu")
    kv = torch.randn(2, 3, 1000, dtype=torch.float16)
    tier.write(b"kv", [kv])
    out = torch.empty_like(kv)
    assert tier.read_into_device(b"kv", out) == kv.numel() * 2
    assert torch.equal(out, kv)
    with pytest.raises(ValueError, match="contiguous"):
        tier.read_into_device(b"kv", torch.empty(2, 6000, dtype=torch.float16).t())


def test_capacity_is_never_exceeded_and_pages_come_back():
    tier = GpuTier(10 * PAGE, page_bytes=PAGE, device="cpu")
    rng = random.Random(1)
    present = {}
    for step in range(400):
        k = bytes([rng.randrange(12)])
        if rng.random() < 0.6:
            n = rng.randint(0, 3 * PAGE)
            try:
                tier.write(k, [blob(n, step)])
                present[k] = (n, step)
            except TierFull:
                pass
        else:
            assert tier.delete(k) == (present.pop(k, None) is not None)
        assert tier.used_bytes == sum(max(1, -(-n // PAGE)) * PAGE for n, _ in present.values())
    assert sorted(tier.keys()) == sorted(present) and len(tier) == len(present)
    for k, (n, step) in present.items():
        assert tier.read(k) == blob(n, step)


def test_delete_during_reads_keeps_readers_consistent():
    tier = GpuTier(64 * PAGE, page_bytes=PAGE, device="cpu")
    values = {bytes([i]): blob(5 * PAGE, i) for i in range(4)}
    stop = threading.Event()
    errors = []

    def reader():
        out = bytearray(5 * PAGE)
        while not stop.is_set():
            for k, v in values.items():
                got = tier.read_into(k, out)
                if got is not None and bytes(out) != v:
                    errors.append(k)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    [t.start() for t in threads]
    for round_ in range(200):
        for k, v in values.items():
            tier.write(k, [v])
            if round_ % 3 == 0:
                tier.delete(k)
    stop.set()
    [t.join() for t in threads]
    assert errors == []
    assert tier.used_bytes == len(tier) * 5 * PAGE


@needs_cuda
def test_on_the_gpu():
    tier = GpuTier(64 << 20, page_bytes=1 << 20)
    data = blob(5 * (1 << 20) + 3, 7)
    tier.write(b"a", [data[:100], memoryview(data)[100:]])
    assert tier.read(b"a") == data
    kv = torch.randn(4, 2, 256, 8, 64, dtype=torch.bfloat16, device="cuda")
    tier.write(b"kv", [kv])
    out = torch.empty_like(kv)
    assert tier.read_into_device(b"kv", out) == kv.numel() * 2
    assert torch.equal(out, kv)
    host = torch.empty(kv.numel() * 2, dtype=torch.uint8)
    assert tier.read_into(b"kv", host.numpy()) == kv.numel() * 2
    assert torch.equal(host.view(torch.bfloat16).view(kv.shape), kv.cpu())
    with pytest.raises(ValueError):
        tier.read_into_device(b"kv", torch.empty_like(kv, device="cpu"))
    assert tier.used_bytes == 6 * (1 << 20) + 2 * (1 << 20)  # 5 MiB + 3 bytes, and the 2 MiB of kv
    tier.close()
