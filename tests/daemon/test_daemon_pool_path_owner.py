"""A host pool at a configured ``store.host.shm_path`` had no owner. The
host tier opens it with O_TRUNC and took no lock, so a second daemon started with the same
configuration (say, beside the first, or while the first still runs) zeroes the first daemon's
host RAM under it: the first daemon's acknowledged chunks are gone, and from then on both
daemons hand out the same pages. The daemon's own pool files (random names under shm.dir) are
locked for their lifetime; a configured one must be as well, and a second daemon refused."""

import asyncio
import threading

import pytest
import torch

from kvstore.client import Client
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon
from kvstore.keys import Namespace, chunk_keys

POOL_OWNER_NS = Namespace("pool-owner", 2, 2, 8, chunk_tokens=8)  # 1 KiB fp16 chunks


class Running:
    """A daemon in this process, on its own event loop."""

    def __init__(self, config: DaemonConfig) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.daemon = Daemon(config)
        try:
            self._call(self.daemon.start())
        except BaseException:
            self.close()
            raise

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        if self.loop.is_running():
            self._call(self.daemon.stop())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
        self.loop.close()


def config(tmp_path, pool) -> DaemonConfig:
    c = DaemonConfig(listen="127.0.0.1:0")
    c.shm.dir = str(tmp_path)
    c.store.host.capacity_bytes = 4 << 20
    c.store.host.page_bytes = 4096
    c.store.host.prefault = False
    c.store.host.shm_path = str(pool)
    c.store.disk.enabled = False  # host RAM only
    return c


def test_a_second_daemon_on_a_configured_pool_file_never_wipes_the_first_ones_chunks(tmp_path):
    pool = tmp_path / "kvstore-pool"
    key = chunk_keys(list(range(8)), POOL_OWNER_NS)[0]
    value = torch.full(POOL_OWNER_NS.chunk_shape, 3.5, dtype=torch.float16)
    first = Running(config(tmp_path, pool))
    try:
        with Client(first.daemon.address, transport="grpc") as client:
            client.put(key, value)
            assert client.lookup([key]) == 1
        second = None
        try:
            second = Running(config(tmp_path, pool))
        except Exception:
            pass  # refused: the pool file is the first daemon's
        finally:
            if second is not None:
                second.close()
        with Client(first.daemon.address, transport="grpc") as client:
            got = client.get([key])
        assert second is None, "a second daemon started on a host pool file a live daemon uses"
        assert len(got) == 1 and torch.equal(got[0], value), \
            "the first daemon lost an acknowledged chunk when a second one started on its pool file"
    finally:
        first.close()
