"""get_blob retried after its first attempt already copied the blob out of its slot.

``ClientCore.get_blob`` passed one ``blobs = [None]`` list to every attempt of ``_retrying``.
On the shm path ``_get_in_slots.place`` replaces ``blobs[0]`` with the slot's bytes as soon as
the CHUNK reply arrives. When the attempt then failed with an error the core retries (the bulk
connection breaks before END, the daemon restarts, the Get took longer than 0.9 x the
daemon's bulk ``pin_ttl_s``), the next attempt found ``bytes`` where it expected None or a
writable view and raised AttributeError ('bytes' object has no attribute 'nbytes') instead
of returning the blob. Both fronts share the core.

Real daemons on loopback. ``broken_once``: the bulk connection breaks once, right after a
Get's CHUNK reply (the ConnectionError ``RecvInto`` raises when the daemon's end goes away).
``slow``: no fault injected; the chunk lies only on a throttled disk, so the first attempt
ends later than 0.9 x pin_ttl_s (the read promotes it and the retry is fast)."""

import asyncio

import pytest
import torch

import kvstore.client.read_path as read_path
from kvstore.blob import encode_header
from kvstore.client import AsyncClient, Client
from kvstore.client.bulk import BulkSession
from kvstore.codecs import resolve_codec
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace, chunk_keys
from kvstore.wire.frames import END

BLOB_RETRY_NS = Namespace("review-blob-retry", num_layers=2, num_kv_heads=2, head_dim=64, chunk_tokens=64)  # 64 KiB


def value(i):
    return torch.full(BLOB_RETRY_NS.chunk_shape, float(i), dtype=torch.float16) + torch.arange(64, dtype=torch.float16)


def expected_blob(key, kv) -> bytes:
    """The raw blob ``put`` stores (kvstore/client/put_path.py ``put``)."""
    raw = resolve_codec("raw")
    payload = raw.encode(kv)
    return bytes(encode_header(key, raw.codec_id, kv.dtype, kv.shape, payload)) + bytes(payload)


def start(tmp_path, slow: bool):
    cfg = tmp_path / "daemon.toml"
    extra = ('[bulk]\npin_ttl_s = 0.2\n[store.host]\ncapacity_bytes = "160KiB"\npage_bytes = 4096\nprefault = false\n'
             '[store.disk]\ncapacity_bytes = "64MiB"\nread_bytes_per_s = 200000\n') if slow else ""  # 64 KiB: ~0.33 s
    cfg.write_text(f'listen = "127.0.0.1:0"\n[shm]\ndir = "{tmp_path}"\nslots = 8\nslot_bytes = "128KiB"\n{extra}')
    proc = DaemonProcess(["--config", str(cfg), "--data-dir", str(tmp_path / "data")])
    keys = chunk_keys(list(range(4 * 64)), BLOB_RETRY_NS)
    with Client(proc.addr, transport="shm") as client:
        for i, k in enumerate(keys if slow else keys[:1]):
            client.put(k, value(i), durable=True)
        if slow:
            assert client.stats().tiers["host"].chunks == 2  # keys[0] is on the slow disk only
    proc.key = keys[0]
    return proc


@pytest.fixture
def broken_once(monkeypatch):
    real = BulkSession.reply
    state = {"broken": False}

    def reply(self):
        kind, meta, data_len = yield from real(self)
        if kind == END and not state["broken"]:
            state["broken"] = True
            raise ConnectionError("the daemon closed the bulk connection")
        return kind, meta, data_len

    monkeypatch.setattr(BulkSession, "reply", reply)
    return state


def get_blob(addr, key, front):
    if front == "sync":
        with Client(addr, transport="shm") as client:
            assert client.path == "shm"
            return client.get_blob(key)

    async def run():
        async with AsyncClient(addr, transport="shm") as client:
            assert await client.path() == "shm"
            return await client.get_blob(key)

    return asyncio.run(run())


@pytest.mark.parametrize("front", ["sync", "async"])
def test_a_get_blob_retried_after_a_broken_connection_returns_the_blob(tmp_path, broken_once, front):
    with start(tmp_path, slow=False) as daemon:
        blob = get_blob(daemon.addr, daemon.key, front)
        assert broken_once["broken"]
        assert blob == expected_blob(daemon.key, value(0))


def test_a_get_blob_retried_after_a_slow_first_attempt_returns_the_blob(tmp_path):
    assert read_path.PIN_MARGIN < 1
    with start(tmp_path, slow=True) as daemon:
        assert get_blob(daemon.addr, daemon.key, "sync") == expected_blob(daemon.key, value(0))
