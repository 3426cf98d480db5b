"""A Put whose blob is in a client's shared-memory slot is stored straight from the slot: the
daemon checks the header, and the Store checksums its own copy in host RAM as it copies it in
(``Store.put_claimed``), so what is checked is what is stored, in one pass over the payload
(before: a copy out of the slot, a verifying pass, and the put's copy). A blob whose payload
does not match its header is refused and leaves nothing behind: no chunk, no host pages."""

import asyncio
import threading
from contextlib import contextmanager

import grpc
import pytest
import torch

from kvstore.blob import encode_header
from kvstore.client import Client, DaemonError
from kvstore.codecs.raw import tensor_bytes
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.server import Daemon
from kvstore.keys import Namespace, chunk_keys

SLOT_PUTS_NS = Namespace("slot-puts", 2, 2, 32, chunk_tokens=32)  # 16 KiB fp16 chunks


@contextmanager
def running_daemon(tmp_path):
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.dir = str(tmp_path)
    config.shm.slot_bytes = 64 << 10
    config.store.host.capacity_bytes = 64 * 4096
    config.store.host.page_bytes = 4096
    config.store.disk.enabled = False
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    daemon = Daemon(config)
    try:
        asyncio.run_coroutine_threadsafe(daemon.start(), loop).result(60)
        yield daemon
    finally:
        asyncio.run_coroutine_threadsafe(daemon.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def blob_of(key, value) -> bytearray:
    payload = tensor_bytes(value)
    return bytearray(encode_header(key, 0, value.dtype, value.shape, payload) + bytes(payload))


def test_a_slot_put_is_stored_as_sent_and_a_damaged_one_leaves_nothing(tmp_path):
    keys = chunk_keys(list(range(2 * SLOT_PUTS_NS.chunk_tokens)), SLOT_PUTS_NS)
    value = torch.randn(SLOT_PUTS_NS.chunk_shape).to(torch.float16)
    with running_daemon(tmp_path) as daemon, Client(daemon.address, transport="shm", retries=0) as client:
        host = daemon.store.tier("host")
        client.put(keys[0], value)
        assert client.path == "shm"
        assert torch.equal(client.get([keys[0]])[0], value)
        used = host.used_bytes
        damaged = blob_of(keys[1], value)
        damaged[5000] ^= 0xFF  # the payload no longer matches the header's checksum
        with pytest.raises(DaemonError) as refused:
            client.put_blob(keys[1], [damaged])
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "checksum" in refused.value.message
        assert client.lookup(keys[1:]) == 0
        assert host.used_bytes == used  # the pages the copy took were given back
        daemon.store.check_integrity()
