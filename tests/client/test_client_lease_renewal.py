"""A lease the client uses all the time expires at the daemon, and the
client then writes a Put's blob into a slot the daemon has leased to another tenant.

The daemon renews a lease when one of its slots is copied into or out of (``SlotArena.using``),
and docs/daemon.md says "Any use renews the lease". A Get whose chunks all lie raw in host RAM
(same-host client, pool views, bulk channel) names the lease's slots but is answered by
``_pin_leading`` alone: ``SlotArena.check`` validates the slots and renews nothing. The client
counts that Get as a use (``ShmLease.touch`` in ``Transports.lease``, even for ``path``) and
skips ``RenewLease`` while its last use is less than ``lease_ttl_s / 2`` old. So a client that
reads hot chunks every 25 s and puts one chunk a minute (lease_ttl_s = 60) has its lease
reclaimed by the daemon while the client thinks it fresh; the slots go to the next client that
leases, here another tenant; the first client's next Put copies its blob into one of them
before the daemon can refuse the stale reference. The other tenant's Get, answered into that
slot, copies the first tenant's blob out of it: wrong bytes, and another tenant's.

Time: the slot arena's and the client lease's clocks (both ``time.monotonic``) are advanced
together by a shared offset, as if the minutes passed; the daemon runs in this process so that
one hook (the other tenant's copy out of its slots, ``read_path.copy_out``) can hold that copy while
the first tenant's Put runs.
"""

from __future__ import annotations

import hashlib
import threading
import time
import types

import pytest
import torch

import kvstore.client.read_path as read_path
import kvstore.client.shm as client_shm
import kvstore.daemon.slots as daemon_slots
from helpers import in_process_daemon
from kvstore.client import Client
from kvstore.daemon.config import DaemonConfig
from kvstore.keys import Namespace, chunk_keys

TOKENS = {"alice": "alice-secret", "bob": "bob-secret"}
TTL_S = 60.0


def ns() -> Namespace:
    return Namespace("review-lease", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB


def value(i: int) -> torch.Tensor:
    return torch.full(ns().chunk_shape, float(i), dtype=torch.float16) + torch.arange(64, dtype=torch.float16)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.fixture
def clock(monkeypatch):
    """A monotonic clock for the slot arena and the client's lease, ``offset`` seconds ahead."""
    shim = types.SimpleNamespace(offset=0.0)
    shim.monotonic = lambda: time.monotonic() + shim.offset
    monkeypatch.setattr(daemon_slots, "time", shim)
    monkeypatch.setattr(client_shm, "time", shim)
    return shim


@pytest.fixture
def daemon(tmp_path, clock):
    tenants = tmp_path / "tenants.toml"
    tenants.write_text("".join(f'[tenants.{n}]\ntoken_sha256 = "{hashlib.sha256(t.encode()).hexdigest()}"\n\n'
                               for n, t in TOKENS.items()))
    config = DaemonConfig(listen="127.0.0.1:0", tenants_file=str(tenants))
    config.shm.dir = str(tmp_path)
    config.shm.slots = 2
    config.shm.slot_bytes = 128 << 10
    config.shm.lease_ttl_s = TTL_S
    config.shm.share_host_pool = True
    config.store.host.capacity_bytes = 16 << 20
    config.store.host.page_bytes = 4096
    config.store.host.prefault = False
    config.store.disk.path = str(tmp_path / "data")
    config.store.disk.capacity_bytes = 32 << 20
    with in_process_daemon(config) as daemon:
        yield daemon


def test_a_lease_in_use_is_never_reclaimed_under_its_client(daemon, clock, monkeypatch):
    addr = daemon.address
    bob_keys = chunk_keys(list(range(5000, 5000 + 2 * 64)), ns())
    with Client(addr, token=TOKENS["bob"], transport="remote") as writer:
        for i, k in enumerate(bob_keys):  # encoded in host RAM: a Get of them goes through slots
            writer.put(k, value(7 + i), codec="lz4")

    alice_key, alice_later = chunk_keys(list(range(2 * 64)), ns())
    alice = Client(addr, token=TOKENS["alice"], shm_slots=2)
    bob = None
    try:
        alice.put(alice_key, value(1))  # through a slot: the daemon renews the lease now
        assert alice.path == "shm"
        out = torch.empty(ns().chunk_shape, dtype=torch.float16)
        for _ in range(2):  # hot reads, well within half the lease's TTL of each other
            clock.offset += 25.0
            assert alice.get_into(alice_key, out) and same(out, value(1))
        clock.offset += 15.0  # 65 s after the put, 15 s after alice's last use

        bob = Client(addr, token=TOKENS["bob"], shm_slots=2)
        real_copy_out = read_path.copy_out
        armed = {"on": True, "alice_put": None}

        def copy_out(placed, pool):
            if armed["on"] and threading.current_thread() is threading.main_thread():
                armed["on"] = False  # bob's chunks are in his slots; alice puts meanwhile

                def put():
                    try:
                        alice.put(alice_later, value(2))
                        armed["alice_put"] = "ok"
                    except Exception as exc:  # noqa: BLE001 - only the slot's bytes matter here
                        armed["alice_put"] = repr(exc)

                t = threading.Thread(target=put)
                t.start()
                t.join(30)
            return real_copy_out(placed, pool)

        monkeypatch.setattr(read_path, "copy_out", copy_out)
        outs = [torch.empty(ns().chunk_shape, dtype=torch.float16) for _ in bob_keys]
        assert bob.get_many_into(bob_keys, outs) == 2
        for i, o in enumerate(outs):
            assert same(o, value(7 + i)), (
                f"bob's chunk {i} holds other bytes: alice's Put wrote its blob into a slot the daemon "
                f"had leased to bob (alice's put: {armed['alice_put']})")
    finally:
        alice.close()
        if bob is not None:
            bob.close()
