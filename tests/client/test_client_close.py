"""``close()`` of a client that other threads (tasks) still call: it refuses new calls with a
clear error, waits for the calls in flight, and only then releases the shared-memory lease
and closes the bulk sessions, so no call copies into or out of a slot after its lease went
back, nor into its caller's tensor after ``close()`` returned, and nothing is left leased.
A daemon in this process; ``read_path.copy_out`` is held where a test needs a call in flight."""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest
import torch

import kvstore.client.read_path as read_path
from helpers import in_process_daemon
from kvstore.client import AsyncClient, Client, DaemonError
from kvstore.client.effects import Rpc
from kvstore.daemon.config import DaemonConfig
from kvstore.keys import Namespace, chunk_keys

SLOTS = 4
CLOSE_NS = Namespace("review-close", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB
KEYS = chunk_keys(list(range(4 * CLOSE_NS.chunk_tokens)), CLOSE_NS)
PUT_KEYS = chunk_keys(list(range(5000, 5000 + 4 * CLOSE_NS.chunk_tokens)), CLOSE_NS)


def value(i: int) -> torch.Tensor:
    return torch.full(CLOSE_NS.chunk_shape, float(i), dtype=torch.float16) + torch.arange(64, dtype=torch.float16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture(params=[False, True], ids=["slots", "pool"])
def daemon(request, tmp_path):
    """Chunks read through slots, or (``pool``) straight out of the shared host pool."""
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.dir = str(tmp_path)
    config.shm.slots = SLOTS
    config.shm.slot_bytes = 128 << 10
    config.shm.share_host_pool = request.param
    config.store.host.capacity_bytes = 16 << 20
    config.store.host.page_bytes = 4096
    config.store.host.prefault = False
    config.store.disk.path = str(tmp_path / "data")
    config.store.disk.capacity_bytes = 32 << 20
    with in_process_daemon(config) as daemon:
        with Client(daemon.address, transport="remote") as writer:
            for i, k in enumerate(KEYS):
                writer.put(k, value(i))
        yield daemon


def assert_nothing_left(addr: str) -> None:
    """Every slot free and no bulk session open at the daemon."""
    with Client(addr, transport="grpc") as observer:
        wait_until(lambda: observer.stats_reply().shm_slots_free == SLOTS, "the lease was never released")
        wait_until(lambda: observer.stats_reply().bulk_sessions == 0, "a bulk session was left open")


def refused(exc: BaseException) -> bool:
    return isinstance(exc, DaemonError) and exc.code == grpc.StatusCode.CANCELLED and "closed" in exc.message


def refuses_new_calls(client) -> bool:
    try:
        client.lookup(KEYS)
    except DaemonError as exc:
        return refused(exc)
    return False


def hold_copies(monkeypatch):
    """Hold every copy out of slots or the pool, except the main thread's, until ``go``."""
    held, go = threading.Event(), threading.Event()
    real_copy_out = read_path.copy_out

    def copy_out(placed, pool):
        if threading.current_thread() is not threading.main_thread():
            held.set()
            go.wait(30)
        return real_copy_out(placed, pool)

    monkeypatch.setattr(read_path, "copy_out", copy_out)
    return held, go


def test_close_waits_for_a_get_in_flight_and_refuses_new_calls(daemon, monkeypatch):
    client = Client(daemon.address, shm_slots=SLOTS)
    assert client.path == "shm"
    held, go = hold_copies(monkeypatch)
    out = torch.zeros(CLOSE_NS.chunk_shape, dtype=torch.float16)
    results = {}

    def run(name, fn):
        try:
            results[name] = fn()
        except BaseException as exc:  # noqa: BLE001
            results[name] = exc

    reader = threading.Thread(target=run, args=("get", lambda: client.get_into(KEYS[1], out)))
    reader.start()
    assert held.wait(10)  # the Get's replies are in; its chunk is still to copy into ``out``
    closer = threading.Thread(target=run, args=("close", client.close))
    closer.start()

    wait_until(lambda: not closer.is_alive() or refuses_new_calls(client), "close() never refused new calls")
    assert closer.is_alive(), "close() returned while a get_into still had to copy into its caller's tensor"
    go.set()
    reader.join(10)
    closer.join(10)
    assert results == {"get": True, "close": None}
    assert same(out, value(1))
    assert_nothing_left(daemon.address)


def test_many_calls_and_a_close_meanwhile(daemon):
    client = Client(daemon.address, shm_slots=SLOTS)
    assert client.path == "shm"
    outs = [torch.zeros(CLOSE_NS.chunk_shape, dtype=torch.float16) for _ in range(4)]
    calls, wrong, errors, put = [0], [], [], set()
    lock = threading.Lock()

    def run(fn) -> bool:
        """Whether to go on: the call returned, or it failed (refused, or an error to report)."""
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            if not refused(exc):
                errors.append(repr(exc))
            return False
        with lock:
            calls[0] += 1
        return True

    def reads(t: int):
        def read():  # each read of a thread names another chunk than its last: one that wrote nothing shows
            if not (client.get_into(KEYS[i], outs[t]) and same(outs[t], value(i))):
                wrong.append((t, i))

        for n in range(10_000):
            i = (t + n) % len(KEYS)
            if not run(read):
                return

    def puts(t: int):
        for n in range(10_000):
            i = (t + n) % len(PUT_KEYS)
            if not run(lambda: client.put(PUT_KEYS[i], value(100 + i))):
                return
            put.add(i)

    threads = [threading.Thread(target=reads, args=(t,)) for t in range(len(outs))]
    threads += [threading.Thread(target=puts, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: calls[0] >= 50, "the calls never ran")
    client.close()
    after_close = [o.clone() for o in outs]
    for t in threads:
        t.join(10)
    assert not errors, f"calls failed with other errors than a refusal: {errors[:3]}"
    assert not wrong, f"gets returned other bytes than their chunk's: {wrong[:3]}"
    changed = [t for t, (o, a) in enumerate(zip(outs, after_close)) if not same(o, a)]
    assert not changed, f"gets wrote into their tensors after close() returned: {changed}"
    assert_nothing_left(daemon.address)
    with Client(daemon.address, transport="remote") as reader:
        for i in put:
            got = reader.get([PUT_KEYS[i]])
            assert len(got) == 1 and same(got[0], value(100 + i)), f"put {i} stored other bytes"


async def close_with_a_get_held(address, out, held):
    """An async client whose get_into is held mid-copy, and its close() started: returned
    once the close refuses new calls (or, wrongly, has returned)."""
    client = AsyncClient(address, shm_slots=SLOTS)
    assert await client.path() == "shm"
    reader = asyncio.create_task(client.get_into(KEYS[1], out))
    assert await asyncio.to_thread(held.wait, 10)
    closer = asyncio.create_task(client.close())

    async def new_call_refused():
        try:
            await client.lookup(KEYS)
        except DaemonError as exc:
            return refused(exc)
        return False

    while not closer.done() and not await new_call_refused():
        pass
    return client, reader, closer


def test_async_close_waits_for_a_get_in_flight_and_refuses_new_calls(daemon, monkeypatch):
    held, go = hold_copies(monkeypatch)  # the async client copies in threads of its own
    out = torch.zeros(CLOSE_NS.chunk_shape, dtype=torch.float16)

    async def scenario():
        client, reader, closer = await close_with_a_get_held(daemon.address, out, held)
        assert not closer.done(), "close() returned while a get_into still had to copy into its caller's tensor"
        go.set()
        assert await reader is True
        await closer

    asyncio.run(scenario())
    assert same(out, value(1))
    assert_nothing_left(daemon.address)


def test_a_cancelled_async_close_still_gives_everything_back(daemon, monkeypatch):
    """A close cancelled while a call is in flight (``asyncio.wait_for``, a cancelled task)
    used to close the channel and stop there: the client stayed closing, its lease and bulk
    session held until their TTL at the daemon, and a second close() could not release them.
    The release now outlives the cancellation, and the call in flight still ends well."""
    held, go = hold_copies(monkeypatch)
    out = torch.zeros(CLOSE_NS.chunk_shape, dtype=torch.float16)

    async def scenario():
        client, reader, closer = await close_with_a_get_held(daemon.address, out, held)
        closer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await closer
        go.set()
        assert await reader is True
        await asyncio.to_thread(assert_nothing_left, daemon.address)  # no second close() needed
        await client.close()

    asyncio.run(scenario())
    assert same(out, value(1))


def test_an_interrupted_close_is_finished_by_the_next(daemon, monkeypatch):
    """Ctrl-C (KeyboardInterrupt) while close() waits for a call in flight used to close the
    channel all the same, so the next close() failed on it and the lease stayed held until
    its TTL at the daemon. The channel now stays open until the release is done."""
    held, go = hold_copies(monkeypatch)
    client = Client(daemon.address, shm_slots=SLOTS)
    assert client.path == "shm"
    out = torch.zeros(CLOSE_NS.chunk_shape, dtype=torch.float16)
    reader = threading.Thread(target=lambda: client.get_into(KEYS[1], out))
    reader.start()
    assert held.wait(10)

    def interrupt():
        wait_until(lambda: refuses_new_calls(client), "close() never refused new calls")
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        interrupter = threading.Thread(target=interrupt)
        interrupter.start()
        with pytest.raises(KeyboardInterrupt):
            client.close()
        interrupter.join(10)
    finally:
        signal.signal(signal.SIGINT, previous)
    go.set()
    reader.join(10)
    assert same(out, value(1))
    client.close()
    assert_nothing_left(daemon.address)


def test_a_release_interrupted_in_close_is_done_by_the_next(daemon):
    """Ctrl-C while close() released the lease used to drop it from the client's books all
    the same: the next close() released nothing and the slots stayed leased until the
    lease's TTL at the daemon."""
    client = Client(daemon.address, shm_slots=SLOTS)
    assert client.path == "shm"
    rpc, interrupted = client._io.perform[Rpc], []

    def interrupt_the_first_release(e: Rpc):
        if e.method == "ReleaseLease" and not interrupted:
            interrupted.append(e)
            raise KeyboardInterrupt
        return rpc(e)

    client._io.perform[Rpc] = interrupt_the_first_release
    with pytest.raises(KeyboardInterrupt):
        client.close()
    client.close()
    assert_nothing_left(daemon.address)
