"""Floods and greedy clients: a connection flood on the bulk and gRPC ports with the daemon
short of descriptors, a tenant over its limits, a client calling Prefetch in a loop. The
daemon sheds what is too much (RESOURCE_EXHAUSTED, closed connections) and keeps serving."""

import socket
import threading
import time

import grpc
import pytest
import torch

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client import Client, DaemonError
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

LIMITS_NS = Namespace("limits", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)  # 16 KiB fp16


def config(tmp_path, name, extra=""):
    path = tmp_path / f"{name}.toml"
    path.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{tmp_path}"\nslots = 16\nslot_bytes = "64KiB"\n'
                    '[store.host]\ncapacity_bytes = "16MiB"\npage_bytes = 4096\nprefault = false\n'
                    f'[store.disk]\ncapacity_bytes = "64MiB"\n{extra}')
    return str(path)


def value(i):
    return torch.full(LIMITS_NS.chunk_shape, float(i % 1000), dtype=torch.float16)


def wait_until(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def flood(port: int, count: int) -> list[socket.socket]:
    """``count`` connections to ``port`` that never say anything (some send garbage)."""
    socks = []
    for i in range(count):
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
        except OSError:
            continue
        if i % 3 == 0:
            try:
                s.sendall(b"\xde\xad\xbe\xef" * 4)
            except OSError:
                pass
        socks.append(s)
    return socks


def test_the_bulk_channel_survives_running_out_of_descriptors(tmp_path):
    """Finding #7: one accept() error (EMFILE) ended the bulk accept loop for good: later
    clients attached over gRPC, connected, and hung for timeout_s on every call."""
    cfg = config(tmp_path, "fds", '[bulk]\nmax_unauthenticated = 10000\nhello_timeout_s = 1.0\n')
    with DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "data")], max_open_files=128) as daemon:
        keys = chunk_keys(list(range(4 * LIMITS_NS.chunk_tokens)), LIMITS_NS)
        with Client(daemon.addr, transport="remote", timeout_s=10) as before:
            for i, k in enumerate(keys):
                before.put(k, value(i))
            assert before.path == "bulk"
            port = before._drive(before._core._call("BulkAttach", pb.BulkAttachRequest())).port
            socks = flood(port, 300)  # more than the daemon has descriptors
            try:
                wait_until(lambda: "accept() failed" in daemon.text, "the daemon never ran out of descriptors")
                assert len(before.get(keys)) == 4  # its attached session kept working
            finally:
                for s in socks:
                    s.close()
        with Client(daemon.addr, transport="remote", timeout_s=10) as after:  # a new session attaches
            got = after.get(keys)
            assert len(got) == 4 and all(torch.equal(g, value(i)) for i, g in enumerate(got))
            assert after.stats_reply().bulk_sessions >= 1


def test_unauthenticated_connections_are_capped_and_time_out(tmp_path):
    cfg = config(tmp_path, "cap", '[bulk]\nmax_unauthenticated = 8\nhello_timeout_s = 0.5\n'
                                  '[limits]\nmax_connections = 16\nhandshake_timeout_s = 1.0\n')
    with DaemonProcess(["--config", cfg, "--data-dir", str(tmp_path / "data")], max_open_files=256) as daemon:
        with Client(daemon.addr, transport="remote", timeout_s=10) as client:
            key = chunk_keys(list(range(LIMITS_NS.chunk_tokens)), LIMITS_NS)[0]
            client.put(key, value(7))
            bulk_port = client._drive(client._core._call("BulkAttach", pb.BulkAttachRequest())).port
            grpc_port = int(daemon.addr.rsplit(":", 1)[1])
            socks = flood(bulk_port, 100) + flood(grpc_port, 100)
            try:
                wait_until(lambda: "have not presented a token yet" in daemon.text, "no connection was refused")
                out = torch.empty(LIMITS_NS.chunk_shape, dtype=torch.float16)
                assert client.get_into(key, out) and torch.equal(out, value(7))  # its session and channel work
                closed = 0
                for s in socks:  # every flooding connection is cut off, quickly
                    s.settimeout(10)
                    try:
                        while s.recv(1 << 16):
                            pass
                    except OSError:
                        pass
                    closed += 1
                assert closed == len(socks)
            finally:
                for s in socks:
                    s.close()
        with Client(daemon.addr, timeout_s=10) as fresh:
            assert fresh.lookup([key]) == 1


@pytest.fixture
def slow_daemon(tmp_path):
    """64 chunks on a slow disk only, and small per-tenant limits."""
    keys = chunk_keys(list(range(64 * LIMITS_NS.chunk_tokens)), LIMITS_NS)
    data = str(tmp_path / "data")
    with DaemonProcess(["--config", config(tmp_path, "fast"), "--data-dir", data]) as first:
        with Client(first.addr) as client:
            for i, k in enumerate(keys):
                client.put(k, value(i), durable=True)
    slow = config(tmp_path, "slow", 'read_bytes_per_s = 400000\n[limits]\nmax_prefetches_per_tenant = 8\n'
                                    'max_requests_per_tenant = 4\n')
    with DaemonProcess(["--config", slow, "--data-dir", data]) as daemon:
        daemon.keys = keys
        yield daemon


def test_prefetch_in_a_loop_queues_no_more_than_its_bound(slow_daemon):
    """Finding #19: Prefetch(wait=false) queued every key of every call (no bound, no dedup)."""
    keys = slow_daemon.keys
    with Client(slow_daemon.addr) as client:
        counts = [len(client.prefetch(keys)) for _ in range(50)]
        assert max(counts) <= 8, counts  # at most 8 running for this tenant, a key never twice
        while client.prefetch(keys, wait=True):  # the rest, 8 at a time, until all are in host RAM
            pass
        hits = client.stats().hits
    assert hits <= 2 * 64, f"{hits} reads for 64 chunks: prefetches were repeated"


def test_a_tenant_over_its_request_limit_is_shed_not_queued(slow_daemon):
    keys = slow_daemon.keys
    results: list = []

    def get(i):
        try:
            with Client(slow_daemon.addr, transport="remote", retries=0, timeout_s=60) as client:
                results.append(len(client.get(keys[i * 8 : i * 8 + 8])))
        except DaemonError as exc:
            results.append(exc.code)

    threads = [threading.Thread(target=get, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    shed = [r for r in results if r == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert shed, results  # 8 slow Gets at once, 4 allowed: some were refused at once
    assert all(r == 8 for r in results if r not in shed)
    with Client(slow_daemon.addr) as client:  # and the daemon is fine afterwards
        assert client.lookup(keys) == 64


def test_a_tenants_flood_of_lookups_and_deletes_is_shed_at_its_request_limit(tmp_path):
    """Lookup, Contains, Pin, Unpin, Delete and Stats ran in the daemon's executor without
    counting against the tenant's request limit: a tenant flooding them filled the executor
    every tenant's calls wait for. Now a call past the limit is refused at once."""
    from kvstore.daemon.config import DaemonConfig
    from helpers import in_process_daemon

    cfg = DaemonConfig(listen="127.0.0.1:0")
    cfg.shm.enabled = False
    cfg.bulk.enabled = False
    cfg.store.host.capacity_bytes = 4 << 20
    cfg.store.host.prefault = False
    cfg.store.disk.enabled = False
    cfg.limits.max_requests_per_tenant = 1
    keys = chunk_keys(list(range(4 * LIMITS_NS.chunk_tokens)), LIMITS_NS)
    with in_process_daemon(cfg) as daemon:
        store = daemon.store
        lookup = store.lookup
        inside, release = threading.Event(), threading.Event()

        def held_lookup(ks):
            inside.set()
            assert release.wait(30)
            return lookup(ks)

        store.lookup = held_lookup
        with Client(daemon.address, transport="grpc", retries=0) as holder, \
                Client(daemon.address, transport="grpc", retries=0) as flooder:
            first = threading.Thread(target=holder.lookup, args=(keys,))
            first.start()
            try:
                assert inside.wait(30)
                calls = {"lookup": lambda: flooder.lookup(keys), "contains": lambda: flooder.contains(keys[0]),
                         "delete": lambda: flooder.delete(keys), "stats": flooder.stats}
                codes = {}
                for name, call in calls.items():
                    try:
                        call()
                        codes[name] = "served"
                    except DaemonError as exc:
                        codes[name] = exc.code
                assert codes == dict.fromkeys(calls, grpc.StatusCode.RESOURCE_EXHAUSTED), codes
            finally:
                release.set()
                first.join(30)
            store.lookup = lookup
            assert flooder.lookup(keys) == 0  # the slot is free again
