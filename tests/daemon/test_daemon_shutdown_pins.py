"""SIGTERM let the pins of a same-host client go before the client was
done with them. A bulk Get answered with pool views leaves the chunk's host-pool pages pinned
until the client's RELEASE. On shutdown the bulk server cuts every idle connection at once,
which releases those pins, while the in-flight RPCs it grants ``shutdown_grace_s`` go on
writing new chunks into the host pool. A client still copying its Get's chunk out of the pool
then copies another chunk's bytes, and returns them as its own."""

import asyncio
import threading
import time

import torch

import kvstore.client.read_path as client_read_path
from kvstore.client import Client
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon
from kvstore.keys import Namespace, chunk_keys

SHUTDOWN_PINS_NS = Namespace("shutdown-pins", 2, 2, 32, chunk_tokens=32)  # 16 KiB fp16 chunks: 5 pages with the header


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_pool_view_stays_pinned_until_its_client_is_done_even_during_shutdown(tmp_path, monkeypatch):
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.dir = str(tmp_path)
    config.shm.slot_bytes = 64 << 10
    config.store.host.capacity_bytes = 6 * 4096  # one chunk and a page
    config.store.host.page_bytes = 4096
    config.store.host.prefault = False
    config.store.disk.enabled = False
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = Daemon(config)
    asyncio.run_coroutine_threadsafe(daemon.start(), loop).result(60)
    stopping = None
    put_go = threading.Event()  # an in-flight put reaches the Store only once this is set
    try:
        x_key, y_key = chunk_keys(list(range(2 * SHUTDOWN_PINS_NS.chunk_tokens)), SHUTDOWN_PINS_NS)
        x = torch.full(SHUTDOWN_PINS_NS.chunk_shape, 1.0, dtype=torch.float16)
        y = torch.full(SHUTDOWN_PINS_NS.chunk_shape, 9.0, dtype=torch.float16)

        # the same-host client's copy out of the pool waits at a gate (after every reply is in)
        copying, copy_go = threading.Event(), threading.Event()
        real_copy_out = client_read_path.copy_out

        def gated_copy_out(placed, pool):
            if any(reply.pool_runs for _, reply, _ in placed):
                copying.set()
                assert copy_go.wait(30)
            real_copy_out(placed, pool)

        monkeypatch.setattr(client_read_path, "copy_out", gated_copy_out)

        real_put = daemon.store.put_claimed

        def gated_put(*args, **kwargs):
            assert put_go.wait(30)
            return real_put(*args, **kwargs)

        with Client(daemon.address, transport="grpc", retries=0) as other:
            other.put(x_key, x)
        reader = Client(daemon.address, transport="shm", retries=0)
        result = {}

        def read():
            try:
                result["got"] = reader.get([x_key])
            except Exception as exc:  # a clean error is fine; another chunk's bytes are not
                result["error"] = exc

        t_read = threading.Thread(target=read)
        t_read.start()
        assert copying.wait(20), "the Get did not get pool views"
        assert reader.path == "shm"

        other = Client(daemon.address, transport="grpc", retries=0)
        other.delete([x_key])  # its pages stay the reader's (pinned) until the reader is done
        daemon.store.put_claimed = gated_put
        put_result = {}

        def put():
            try:
                other.put(y_key, y)
                put_result["ok"] = True
            except Exception as exc:
                put_result["error"] = exc

        t_put = threading.Thread(target=put)
        t_put.start()
        wait_for(lambda: daemon.service.io_inflight >= 1, "the put to be in flight")

        stopping = asyncio.run_coroutine_threadsafe(daemon.stop(), loop)  # SIGTERM
        wait_for(lambda: daemon.bulk.sessions == 0, "the bulk server to close the reader's connection")
        put_go.set()  # the in-flight put finishes within the grace period
        t_put.join(20)
        copy_go.set()  # ... and then the reader copies its chunk out of the pool
        t_read.join(20)
        reader.close()
        other.close()
        if "got" in result:
            got = result["got"]
            assert len(got) == 1
            assert torch.equal(got[0], x), \
                f"the Get of x returned other bytes (values {sorted(set(got[0].flatten().tolist()))[:4]})"
    finally:
        put_go.set()
        if stopping is None:
            stopping = asyncio.run_coroutine_threadsafe(daemon.stop(), loop)
        stopping.result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
