"""The asyncio client connected its bulk channel to the first address the daemon's host name
resolved to, and to no other; the blocking client (``socket.create_connection``) tries each.

With the common /etc/hosts (``::1 localhost`` and ``127.0.0.1 localhost``) "localhost"
resolves to ::1 first. A daemon listening on 127.0.0.1 (the default, ``kvstore serve``)
addressed as "localhost:PORT": ``Client`` worked; every ``AsyncClient`` Get and Put failed
with UNAVAILABLE "bulk channel: Connect call failed ('::1', ...)" after its retries
(kvstore/client/aio.py ``_Awaiting._connect``: ``getaddrinfo(...)[0]``).

The resolver is made to answer as that /etc/hosts does (this machine's lists 127.0.0.1
only); gRPC resolves on its own and reaches the daemon either way. A real daemon process."""

import asyncio
import math
import socket

import pytest
import torch

from kvstore.client import AsyncClient, Client
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

RESOLVE_NS = Namespace("review-resolve", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=8)  # 1 KiB


@pytest.fixture
def localhost_is_v6_first(monkeypatch):
    real = socket.getaddrinfo

    def resolve(host, port, *args, **kwargs):
        found = real(host, port, *args, **kwargs)
        if host == "localhost" and isinstance(port, int):
            return [(socket.AF_INET6, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("::1", port, 0, 0))] + list(found)
        return found

    monkeypatch.setattr(socket, "getaddrinfo", resolve)


@pytest.fixture
def daemon(tmp_path):
    with DaemonProcess(["--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"), "--host-bytes", "16MiB",
                        "--disk-bytes", "16MiB"]) as proc:
        yield proc


def test_both_clients_reach_a_daemon_named_localhost(daemon, localhost_is_v6_first):
    addr = "localhost:" + daemon.addr.rsplit(":", 1)[1]
    key = chunk_keys(list(range(RESOLVE_NS.chunk_tokens)), RESOLVE_NS)[0]
    kv = torch.arange(math.prod(RESOLVE_NS.chunk_shape), dtype=torch.float16).view(RESOLVE_NS.chunk_shape)

    with Client(addr, transport="remote", retries=1) as client:
        client.put(key, kv)
        assert client.path == "bulk"
        assert torch.equal(client.get([key])[0], kv)

    async def run():
        async with AsyncClient(addr, transport="remote", retries=1) as client:
            await client.put(key, kv)
            assert await client.path() == "bulk"
            got = await client.get([key])
            assert len(got) == 1 and torch.equal(got[0], kv)

    asyncio.run(run())
