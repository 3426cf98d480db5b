"""Test furniture the store tests share: the default namespace NS (1 KiB chunks) and a
wider one (16 KiB chunks), chunks of random KV, bit-exact
comparison, and a Store config builder on tiny pages."""

from __future__ import annotations

from contextlib import contextmanager

import torch

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, WriteBehindConfig
from kvstore.keys import Namespace, chunk_keys

PAGE = 4096
NS = Namespace("test-model", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=8)  # 1 KiB fp16 chunks
WIDE_NS = Namespace("test-model", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=16)  # 16 KiB fp16 chunks


def chunks(n: int, ns: Namespace = NS, seed: int = 0):
    """``n`` keys of one prefix and a random chunk for each."""
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 50_000, (n * ns.chunk_tokens,), generator=gen).tolist(), ns)
    return keys, [torch.randn(ns.chunk_shape, generator=gen).to(ns.torch_dtype) for _ in keys]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def store_config(tmp_path, host: int = 64 * PAGE, disk: int | None = 1 << 20, pending: int = 16 * PAGE,
                 **kw) -> StoreConfig:
    """Host RAM of ``host`` bytes on 4 KiB pages and, unless ``disk`` is None, a disk tier
    under ``tmp_path/data``; other StoreConfig fields by keyword."""
    return StoreConfig(
        host=HostTierConfig(capacity_bytes=host, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(path=str(tmp_path / "data"), capacity_bytes=disk or 1, enabled=disk is not None),
        write_behind=WriteBehindConfig(max_pending_bytes=pending),
        **kw,
    )


@contextmanager
def in_process_daemon(config):
    """A daemon in this process (so a test can reach into its Store), serving on an event loop
    of its own thread; stopped when the block ends."""
    import asyncio
    import threading

    from kvstore.daemon.server import Daemon

    loop = asyncio.new_event_loop()
    daemon = Daemon(config)
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(daemon.start(), loop).result(60)
        yield daemon
        asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result(60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def store_with_faulty_disk(tmp_path, host_pages: int, workers: int = 2, stall_s: float = 120.0,
                           delay_s: float | None = None):
    """A Store with write-behind's defaults (no ``max_pending_bytes``) whose disk is a real
    disk tier behind a FaultyTier (tests/faults.py); ``delay_s`` 0 where the test's clock does
    not move by itself. Returns (store, disk)."""
    from faults import FaultyTier
    from kvstore.store import Store
    from tiers.disk import DiskTier

    cfg = store_config(tmp_path, host=host_pages * PAGE, disk=None, pending=None)
    cfg.write_behind.workers = workers
    cfg.write_behind.stall_s = stall_s
    if delay_s is not None:
        cfg.write_behind.delay_s = delay_s
    disk = FaultyTier(DiskTier(tmp_path / "disk", 1 << 22, name="disk"))
    return Store(cfg, extra_tiers=[disk]), disk
