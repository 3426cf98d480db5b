"""Anyone who reaches the bulk port can hold its ``max_unauthenticated`` connections with
silent ones (no credential needed); the daemon then closes every new bulk connection at once
(kvstore/daemon/bulk.py). A client whose bulk connection was closed before the hello reply
retried the call on the same closed port and failed with UNAVAILABLE "bulk channel: ..."
after its retries, so the flood stopped every tenant's Gets and Puts. Now such a call goes
over gRPC (slower, same bytes) and the client tries bulk again later, once the flood is gone.

A real daemon process, with room for two unauthenticated connections. Which path served a
call: the daemon's count of attached bulk sessions (a client keeps its session attached
between calls), and the client's ``path``."""

import asyncio
import math
import socket
import time

import pytest
import torch

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client import AsyncClient, Client
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

BULK_FLOOD_NS = Namespace("review-bulk-flood", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=8)  # 1 KiB
KEYS = chunk_keys(list(range(3 * BULK_FLOOD_NS.chunk_tokens)), BULK_FLOOD_NS)
HELD = 2  # the daemon's max_unauthenticated
WAIT_S = 10.0


def chunk(i: int) -> torch.Tensor:
    return (torch.arange(math.prod(BULK_FLOOD_NS.chunk_shape), dtype=torch.float16) + i).view(BULK_FLOOD_NS.chunk_shape)


def right(got: list[torch.Tensor]) -> bool:
    return len(got) == len(KEYS) and all(torch.equal(g, chunk(i)) for i, g in enumerate(got))


@pytest.fixture
def daemon(tmp_path):
    """The silent connections stay held for the whole test (hello_timeout_s)."""
    cfg = tmp_path / "daemon.toml"
    cfg.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{tmp_path}"\nslots = 16\nslot_bytes = "64KiB"\n'
                   '[store.host]\ncapacity_bytes = "16MiB"\npage_bytes = 4096\nprefault = false\n'
                   '[store.disk]\ncapacity_bytes = "16MiB"\n'
                   f'[bulk]\nmax_unauthenticated = {HELD}\nhello_timeout_s = 120.0\n')
    with DaemonProcess(["--config", str(cfg), "--data-dir", str(tmp_path / "data")]) as proc:
        with Client(proc.addr, transport="grpc") as observer:
            proc.observer = observer
            proc.bulk_port = observer._drive(observer._core._call("BulkAttach", pb.BulkAttachRequest())).port
            yield proc


def attached(daemon) -> int:
    return daemon.observer.stats_reply().bulk_sessions


def flood(port: int) -> list[socket.socket]:
    """``HELD`` connections that never present a token, held by the daemon: a connection
    opened after them is closed at once (it is accepted after them, in order)."""
    held = [socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) for _ in range(HELD)]
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT_S) as probe:
        try:
            assert probe.recv(1) == b"", "the daemon answered a connection that sent nothing"
        except ConnectionResetError:
            pass
    return held


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + 6 * WAIT_S  # bulk is tried again after 1 s, 2 s, ... while it fails
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("transport", ["remote", "auto"])
def test_a_client_puts_and_gets_over_grpc_while_the_bulk_port_is_flooded(daemon, transport):
    with Client(daemon.addr, transport=transport, timeout_s=WAIT_S) as client:
        held = flood(daemon.bulk_port)
        try:
            for i, k in enumerate(KEYS):
                client.put(k, chunk(i))
            assert right(client.get(KEYS))
            assert attached(daemon) == 0, "a bulk session attached through the flood"
            assert client.path == ("grpc" if transport == "remote" else "shm")
        finally:
            for s in held:
                s.close()
        wait_until(lambda: right(client.get(KEYS)) and attached(daemon) == 1, "the client never took bulk again")
        if transport == "remote":
            assert client.path == "bulk"


def test_an_async_client_puts_and_gets_over_grpc_while_the_bulk_port_is_flooded(daemon):
    async def run():
        async with AsyncClient(daemon.addr, transport="remote", timeout_s=WAIT_S) as client:
            held = flood(daemon.bulk_port)
            try:
                for i, k in enumerate(KEYS):
                    await client.put(k, chunk(i))
                assert right(await client.get(KEYS))
                assert attached(daemon) == 0, "a bulk session attached through the flood"
                assert await client.path() == "grpc"
            finally:
                for s in held:
                    s.close()
            deadline = time.monotonic() + WAIT_S
            while not (right(await client.get(KEYS)) and attached(daemon) == 1):
                assert time.monotonic() < deadline, "the client never took bulk again"
                await asyncio.sleep(0.01)
            assert await client.path() == "bulk"

    asyncio.run(run())
