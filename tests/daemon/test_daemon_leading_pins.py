"""The leading chunks of a Get that lie raw in host RAM are pinned together before the first
reply: the first ``LOOP_PINS`` on the event loop where a pin hashes no payload, the rest in
one executor call (all of them there where the host tier verifies payloads). A Get longer
than ``LOOP_PINS``, with its first miss on either side of that bound, hands over every chunk
before the miss, read out of the mapped pool, and leaves no pin held."""

from __future__ import annotations

import pytest
import torch

from faults import wait_until
from helpers import chunks
from kvstore.client import Client
from kvstore.client.bulk import BulkSession
from kvstore.daemon.chunk_reads import LOOP_PINS
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace

PINS_NS = Namespace("leading-pins", 1, 2, 32, dtype="float32", chunk_tokens=64)  # 32 KiB chunks, larger than a slot
N = LOOP_PINS + 8


@pytest.fixture(scope="module", params=[False, True], ids=["pins-on-the-loop", "host-verifies-payloads"])
def daemon(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("leading-pins")
    (root / "daemon.toml").write_text(
        '[shm]\nslots = 16\nslot_bytes = "16KiB"\n'
        f'[store.host]\ncapacity_bytes = "16MiB"\npage_bytes = 4096\nverify_payload = {str(request.param).lower()}\n'
        '[store.disk]\nenabled = false\n')
    with DaemonProcess(["--config", str(root / "daemon.toml"), "--listen", "127.0.0.1:0"]) as proc:
        yield proc


@pytest.mark.parametrize("miss", [None, LOOP_PINS // 2, LOOP_PINS, LOOP_PINS + 3])
def test_a_get_longer_than_the_loop_pins_reads_every_leading_chunk_from_the_pool(daemon, monkeypatch, miss):
    received = []  # chunk bytes that came over the socket
    recv_into = BulkSession.recv_into

    def recorded(self, view):
        received.append(view.nbytes)
        return recv_into(self, view)

    monkeypatch.setattr(BulkSession, "recv_into", recorded)
    with Client(daemon.addr, transport="shm") as client:
        keys, data = chunks(N, PINS_NS, seed=3 + (miss or 0))
        for key, kv in zip(keys, data):
            client.put(key, kv)
        if miss is not None:
            assert client.delete([keys[miss]]) == 1
        leading = N if miss is None else miss
        outs = [torch.zeros(PINS_NS.chunk_shape) for _ in keys]
        assert client.get_many_into(keys, outs) == leading
        seen = []
        assert client.get_with(keys, lambda i, t: seen.append((i, t.clone())) or True) == leading
        for i in range(leading):
            assert torch.equal(outs[i], data[i]) and seen[i][0] == i and torch.equal(seen[i][1], data[i])
        assert received == [], "a chunk came over the socket, not out of the pool"
        assert client.delete(keys) == N - (miss is not None)
        wait_until(lambda: client.stats().tiers["host"].used_bytes == 0, what="a pin of the Get is still held")
