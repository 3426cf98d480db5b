"""A client that called while its daemon was restarting never used shared memory again.

After the daemon went away, the client's next call finds its bulk session broken, retires
its lease and asks for a new one (``Transports.lease``). The daemon is not back yet: the
Lease RPC failed with UNAVAILABLE, which ``_shm`` took for "shared memory is out of reach"
(``self._shm_tried = True``); nothing reset that flag while the client held no lease, so
once the daemon was back (same address, same host) every Get and Put of this client took
the socket path for good (``path`` answers "bulk", not "shm"; the docs measure shm Gets at
4x the bulk channel's speed). UNAVAILABLE says the daemon is unreachable now, the one error
the client retries, not that shared memory is.

Real daemon processes on loopback, the second on the first one's address and data."""

import asyncio
import time

import pytest
import torch

from kv_daemon import TOKEN, start_daemon
from kvstore.client import AsyncClient, DaemonError
from kvstore.keys import Namespace, chunk_keys


RESTART_NS = Namespace("review-restart", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=8)  # 1 KiB


def test_the_async_client_takes_shared_memory_again_after_a_daemon_restart(tmp_path):
    key = chunk_keys(list(range(RESTART_NS.chunk_tokens)), RESTART_NS)[0]
    kv = torch.arange(RESTART_NS.chunk_bytes // 2, dtype=torch.float16).view(RESTART_NS.chunk_shape)
    first = start_daemon(tmp_path / "d")
    addr = first.addr

    async def scenario():
        client = AsyncClient(addr, token=TOKEN, retries=1, backoff_s=0.01)
        try:
            with first:
                await client.put(key, kv, durable=True)
                assert await client.path() == "shm"
            with pytest.raises(DaemonError):  # the daemon is down: the call fails, as it should
                await client.get([key])
            with start_daemon(tmp_path / "d", listen=addr):
                deadline = time.monotonic() + 20
                while True:  # until gRPC has reconnected
                    try:
                        got = await client.get([key])
                        break
                    except DaemonError:
                        assert time.monotonic() < deadline, "the client never reached the restarted daemon"
                        await asyncio.sleep(0.2)
                assert len(got) == 1 and torch.equal(got[0], kv)
                assert await client.path() == "shm"
        finally:
            await client.close()

    asyncio.run(scenario())
