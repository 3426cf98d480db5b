"""A Lease whose reply never reaches the client (its deadline passed, its caller cancelled)
is granted at the daemon all the same; the client names every Lease request, and releases
the lease of one that got no answer on its next call, so the slots come back at once, not
after the lease's lifetime (60 s here). A daemon in this process whose Lease handler grants
and then loses its reply."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import kvstore.client.transports as transports
from helpers import in_process_daemon
from kvstore.client import Client
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.service import KVStoreService
from kvstore.keys import Namespace, chunk_keys

SLOTS = 4
LEASE_UNANSWERED_NS = Namespace("lease-unanswered", num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)
KEYS = chunk_keys(list(range(2 * LEASE_UNANSWERED_NS.chunk_tokens)), LEASE_UNANSWERED_NS)


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.fixture
def daemon(tmp_path, monkeypatch):
    granted = threading.Event()
    grant = KVStoreService.Lease

    async def lease_then_lose_the_first_reply(self, request, caller):
        reply = await grant(self, request, caller)
        if not granted.is_set():
            granted.set()
            await asyncio.sleep(5)  # past the client's deadline: the reply never reaches it
        return reply

    monkeypatch.setattr(KVStoreService, "Lease", lease_then_lose_the_first_reply)
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.dir = str(tmp_path)
    config.shm.slots = SLOTS
    config.shm.slot_bytes = 64 << 10
    config.shm.lease_ttl_s = 60.0
    config.store.host.capacity_bytes = 8 << 20
    config.store.host.prefault = False
    config.store.disk.enabled = False
    with in_process_daemon(config) as d:
        d.granted = granted
        yield d


def test_a_lease_whose_reply_was_lost_is_released_by_the_clients_next_call(daemon, monkeypatch):
    monkeypatch.setattr(transports, "LEASE_AGAIN_S", 0.2)
    value = torch.randn(LEASE_UNANSWERED_NS.chunk_shape).half()
    with Client(daemon.address, shm_slots=SLOTS, timeout_s=1.0) as client:
        client.put(KEYS[0], value)  # its Lease timed out: put over the bulk channel instead
        assert daemon.granted.is_set() and daemon.arena.free_slots == 0
        got = client.get(KEYS[:1])  # the next call releases what the lost Lease was granted
        assert len(got) == 1 and torch.equal(got[0], value)
        wait_until(lambda: daemon.arena.free_slots == SLOTS, "the lost Lease's slots stayed leased")
        # a Lease without an answer says nothing of shared memory: tried again after LEASE_AGAIN_S
        wait_until(lambda: client.path == "shm", "the client never took shared memory again")
