"""A client's retired shared-memory lease (kvstore/client/shm.py): once one call of a client
ends without an answer, the lease's slots are handed out no more, and the lease is released
only when no other call of that client still copies into or out of one of them. Otherwise the
daemon may lease the slot to anybody (another tenant) while the first call still uses it.
Real daemons on loopback, with a throttled disk for the call that times out."""

import hashlib
import threading
import time

import pytest
import torch

import kvstore.client.read_path as read_path
from kvstore.client import Client, DaemonError
from kvstore.client.bulk import BulkSession
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys

TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
SLOW = 128_000  # disk bytes per second: a 64 KiB chunk takes ~0.5 s to read


def ns(tenant: str = "") -> Namespace:
    return Namespace("review", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64, tenant=tenant)  # 64 KiB


def value(i):
    return torch.full(ns().chunk_shape, float(i), dtype=torch.float16) + torch.arange(64, dtype=torch.float16)


def same(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def wait_until(predicate, what: str, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def eventually(predicate, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def files(tmp_path, disk_bytes_per_s: int):
    cfg = tmp_path / f"daemon-{disk_bytes_per_s}.toml"
    cfg.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{tmp_path}"\nslots = 2\nslot_bytes = "128KiB"\n'
                   f'lease_ttl_s = 60.0\nshare_host_pool = false\n'
                   f'[store.host]\ncapacity_bytes = "16MiB"\npage_bytes = 4096\nprefault = false\n'
                   f'[store.disk]\ncapacity_bytes = "64MiB"\nread_bytes_per_s = {disk_bytes_per_s}\n')
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{n}]\ntoken_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n\n'
                               for n, t in TOKENS.items()))
    return ["--config", str(cfg), "--tenants-file", str(tenants), "--data-dir", str(tmp_path / "data")]


def test_a_get_never_copies_out_of_a_slot_its_client_released_meanwhile(tmp_path, monkeypatch):
    slow_key, fast_key = chunk_keys(list(range(2 * 64)), ns())
    with DaemonProcess(files(tmp_path, 0)) as first:  # a chunk on disk only, after a restart
        with Client(first.addr, token=TOKENS["alice"]) as alice:
            alice.put(slow_key, value(0), durable=True)

    with DaemonProcess(files(tmp_path, SLOW)) as daemon:
        alice = Client(daemon.addr, token=TOKENS["alice"], shm_slots=2, timeout_s=0.3, retries=0)
        alice.put(fast_key, value(1))  # in host RAM: its Get is answered at once, into slot 0
        assert alice.path == "shm"

        at_copy, go = threading.Event(), threading.Event()
        real_copy_out = read_path.copy_out
        reader = {}

        def gated_copy_out(placed, pool):
            if threading.current_thread() is reader.get("thread"):
                at_copy.set()  # every reply of the Get is in; the chunk waits in its slot
                go.wait(60)
            return real_copy_out(placed, pool)

        monkeypatch.setattr(read_path, "copy_out", gated_copy_out)
        out = torch.empty(ns().chunk_shape, dtype=torch.float16)

        def read():
            try:
                reader["hit"] = alice.get_into(fast_key, out)
            except BaseException as exc:  # noqa: BLE001
                reader["error"] = exc

        reader["thread"] = t = threading.Thread(target=read)
        t.start()
        assert at_copy.wait(30)

        # another call of the same client ends without an answer (a slow disk, its deadline):
        # the lease is retired, and the client's next call releases it
        with pytest.raises(DaemonError):
            alice.get_into(slow_key, torch.empty(ns().chunk_shape, dtype=torch.float16))
        alice.path  # noqa: B018  (any call: before the fix, ReleaseLease of the retired lease)

        with Client(daemon.addr, token=TOKENS["alice"], transport="grpc") as observer:
            wait_until(lambda: observer.stats_reply().hits >= 2, "the timed-out read never ended")
            # before the fix the released lease's slots are free once that read's slot is; with
            # it they stay leased until the read below is done, and this gives up after 2 s
            freed = eventually(lambda: observer.stats_reply().shm_slots_free == 2, timeout_s=2)

        # another tenant leases whatever slots are free and puts two chunks of its own: before
        # the fix through both slots, one of which the read had not copied out of yet
        with Client(daemon.addr, token=TOKENS["bob"], shm_slots=2) as bob:
            for i, bob_key in enumerate(chunk_keys(list(range(5000, 5128)), ns())):
                bob.put(bob_key, value(7 + i))

        go.set()
        t.join(30)
        assert reader.get("hit") is True, reader
        assert same(out, value(1)), f"get_into returned True with another chunk's bytes (slots freed: {freed})"
        alice.close()  # the retired lease's slots are all back: it is released now
        with Client(daemon.addr, token=TOKENS["alice"], transport="grpc") as observer:
            wait_until(lambda: observer.stats_reply().shm_slots_free == 2, "the retired lease was never released")


def test_a_put_never_writes_a_slot_of_a_lease_released_after_it_started(tmp_path, monkeypatch):
    slow_key, put_key = chunk_keys(list(range(2 * 64)), ns())
    with DaemonProcess(files(tmp_path, 0)) as first:
        with Client(first.addr, token=TOKENS["alice"]) as alice:
            alice.put(slow_key, value(0), durable=True)

    with DaemonProcess(files(tmp_path, SLOW)) as daemon:
        bob_keys = chunk_keys(list(range(5000, 5000 + 2 * 64)), ns())
        with Client(daemon.addr, token=TOKENS["bob"], transport="remote") as bob:
            for i, k in enumerate(bob_keys):
                bob.put(k, value(7 + i))  # in host RAM: answered at once, into slots

        alice = Client(daemon.addr, token=TOKENS["alice"], shm_slots=2, timeout_s=0.3, retries=0)
        threads = {}
        attached, go_put = threading.Event(), threading.Event()
        real_open = BulkSession.open.__func__

        def gated_open(cls, host, reply):
            session = yield from real_open(cls, host, reply)
            if threading.current_thread() is threads.get("put"):
                attached.set()  # the Put holds the lease object, and has not taken its slot yet
                go_put.wait(60)
            return session

        monkeypatch.setattr(BulkSession, "open", classmethod(gated_open))
        at_copy, go_copy = threading.Event(), threading.Event()
        real_copy_out = read_path.copy_out

        def gated_copy_out(placed, pool):
            if threading.current_thread() is threads.get("get"):
                at_copy.set()
                go_copy.wait(60)
            return real_copy_out(placed, pool)

        monkeypatch.setattr(read_path, "copy_out", gated_copy_out)
        result = {}

        def put():
            try:
                alice.put(put_key, value(1))
            except BaseException as exc:  # noqa: BLE001
                result["put_error"] = exc

        threads["put"] = tp = threading.Thread(target=put)
        tp.start()
        assert attached.wait(30)

        # another call of alice's ends without an answer: the lease is retired, then released
        with pytest.raises(DaemonError):
            alice.get_into(slow_key, torch.empty(ns().chunk_shape, dtype=torch.float16))
        alice.path  # noqa: B018
        with Client(daemon.addr, token=TOKENS["alice"], transport="grpc") as observer:
            wait_until(lambda: observer.stats_reply().shm_slots_free == 2, "the released lease never came back")

        # bob leases the freed slots; his Get is answered into them
        bob = Client(daemon.addr, token=TOKENS["bob"], transport="shm", shm_slots=2)
        outs = [torch.empty(ns().chunk_shape, dtype=torch.float16) for _ in bob_keys]

        def get():
            try:
                result["got"] = bob.get_many_into(bob_keys, outs)
            except BaseException as exc:  # noqa: BLE001
                result["get_error"] = exc

        threads["get"] = tg = threading.Thread(target=get)
        tg.start()
        assert at_copy.wait(30)
        go_put.set()  # alice's Put takes a slot of her released lease and writes into it
        tp.join(30)
        go_copy.set()
        tg.join(30)
        alice.close()
        bob.close()
        assert "get_error" not in result, result
        assert result["got"] == 2
        assert "put_error" not in result, result  # alice's Put was retried elsewhere and succeeded
        wrong = [i for i, o in enumerate(outs) if not same(o, value(7 + i))]
        with Client(daemon.addr, token=TOKENS["alice"]) as again:
            alice_blob = again.get_blob(put_key)
        hers = [i for i in wrong if bytes(outs[i].view(torch.uint8).numpy()) == alice_blob[: outs[i].numel() * 2]]
        assert not wrong, f"bob's Get returned 2 hits, chunks {wrong} wrong; {hers} hold alice's put blob"
