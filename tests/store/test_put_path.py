"""The put path (kvstore/store/put_path.py): a put parses its blob's header once, whoever
received the blob, and profiling codecs for placement never runs on a put's thread."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch

import kvstore.blob
from helpers import NS, chunks, in_process_daemon, same, store_config
from kvstore.blob import encode_header
from kvstore.client import Client
from kvstore.config import PlacementConfig
from kvstore.daemon.config import DaemonConfig
from kvstore.store import Store
from kvstore.store.placement import Placement


@pytest.fixture
def parses(monkeypatch):
    """Calls of ``decode_header``, the one function that parses a blob header, from any module
    that imported it (each holds its own reference), on any thread."""
    original = kvstore.blob.decode_header
    calls = []

    def counted(data):
        calls.append(threading.current_thread().name)
        return original(data)

    for module in list(sys.modules.values()):
        if getattr(module, "decode_header", None) is original:
            monkeypatch.setattr(module, "decode_header", counted)
    return calls


def placed(tmp_path) -> PlacementConfig:
    """Placement that measures int8 on the test model's chunks (it profiles each new shape)."""
    verdicts = tmp_path / "verdicts.json"
    verdicts.write_text(json.dumps({"schema": "kvstore.codec-verdicts/2", "model": "test", "model_id": NS.model_id,
                                    "dtype": "float16", "codecs": {"int8": {"allowed": True, "ppl_change_pct": 0.1}}}))
    return PlacementConfig(codecs=["int8"], verdicts=[str(verdicts)])


def test_a_put_blob_parses_its_header_once(tmp_path, parses):
    keys, values = chunks(2)
    with Store(store_config(tmp_path, disk=None, placement=placed(tmp_path))) as store:
        for key, value in zip(keys, values):
            payload = store.codec.encode(value)
            blob = [encode_header(key, store.codec.codec_id, value.dtype, value.shape, payload), payload]
            parses.clear()
            store.put_blob(key, blob)
            assert len(parses) == 1, parses
        out = torch.empty_like(values[0])
        assert store.get_into(keys[0], out) and same(out, values[0])


def test_a_put_and_a_re_put_of_a_tensor_parse_no_header(tmp_path, parses):
    """The Store packs the header itself: it knows it without reading it back."""
    keys, values = chunks(1)
    with Store(store_config(tmp_path, disk=None, placement=placed(tmp_path))) as store:
        store.put(keys[0], values[0])
        store.put(keys[0], values[0], codec="int8")  # another blob of the chunk: a new version
        store.put(keys[0], values[0], codec="int8")  # the same blob again: an access
        assert parses == []
        assert store.stats().puts == 3


def test_a_put_through_the_daemon_parses_its_header_once(tmp_path, parses):
    """The daemon verifies the blob (one parse) and hands the Store the header it parsed."""
    config = DaemonConfig(listen="127.0.0.1:0")
    config.shm.enabled = False
    config.store = store_config(tmp_path, disk=None, placement=placed(tmp_path))
    keys, values = chunks(2)
    with in_process_daemon(config) as daemon, Client(daemon.address, transport="remote") as client:
        client.put(keys[0], values[0])  # connected, namespace sent
        parses.clear()
        client.put(keys[1], values[1])
        assert len(parses) == 1, parses
        out = torch.empty_like(values[1])
        assert client.get_into(keys[1], out) and same(out, values[1])


def test_profiling_a_new_shape_runs_off_the_puts_thread(tmp_path, monkeypatch):
    """Puts that need no room return while the profile their shape asked for is measured."""
    profiled_on = []
    measure = threading.Event()
    profile = Placement.profile

    def gated(self, dtype, shape):
        profiled_on.append(threading.current_thread().name)
        measure.wait(10)  # on the put's thread (before), the put returns only after this
        profile(self, dtype, shape)

    monkeypatch.setattr(Placement, "profile", gated)
    keys, values = chunks(3)
    with Store(store_config(tmp_path, disk=None, placement=placed(tmp_path))) as store:
        for key, value in zip(keys, values):
            store.put(key, value)
        assert not store.placement.profiled(NS.torch_dtype, NS.chunk_shape)  # still held: no put waited for it
        measure.set()
        deadline = time.monotonic() + 60
        while not store.placement.profiled(NS.torch_dtype, NS.chunk_shape):
            assert time.monotonic() < deadline, "the shape was never profiled"
            time.sleep(0.01)
    assert len(profiled_on) == 1 and profiled_on[0].startswith("codec-profile"), profiled_on


def test_put_claimed_stores_a_payload_that_matches_its_header_and_nothing_else(tmp_path):
    """``Store.put_claimed`` checks the payload as the first tier copies it in: a damaged one
    raises, and the store holds no chunk, no index entry and no host pages for it."""
    from kvstore.blob import PayloadChecksumMismatch, decode_header
    from kvstore.codecs.raw import tensor_bytes

    keys, values = chunks(2)
    with Store(store_config(tmp_path)) as store:
        host = store.tier("host")
        for key, value, damage in ((keys[0], values[0], False), (keys[1], values[1], True)):
            payload = bytearray(tensor_bytes(value))
            head = encode_header(key, 0, value.dtype, value.shape, payload)
            if damage:
                payload[100] ^= 0xFF
            used = host.used_bytes
            if damage:
                with pytest.raises(PayloadChecksumMismatch):
                    store.put_claimed(key, head, decode_header(head), payload)
                assert host.used_bytes == used and store.lookup([key]) == 0
            else:
                store.put_claimed(key, head, decode_header(head), payload)
                out = torch.empty_like(value)
                assert store.get_into(key, out) and same(out, value)
        store.check_integrity()


def test_a_claimed_blob_written_to_a_tier_that_hashes_its_source_is_what_was_checked(tmp_path):
    """``Tier.write_sealed``'s default hashes the source, then copies it: a client that rewrote
    its slot in between got bytes stored that its header's checksum does not match. A tier
    that does not hash its own copy (``hashes_its_copy``) gets a private copy of the payload."""
    from faults import Call, FaultyTier, Gate
    from kvstore.blob import ClaimedBlob, decode_header, verify_blob
    from kvstore.codecs.raw import tensor_bytes
    from tiers.disk import DiskTier

    (key,), (value,) = chunks(1)
    tier = FaultyTier(DiskTier(tmp_path / "disk", 1 << 22, name="disk"))
    assert not tier.hashes_its_copy
    slot = bytearray(tensor_bytes(value))  # the sender's memory
    head = encode_header(key, 0, value.dtype, value.shape, slot)
    hold = tier.gates["write"] = Gate()
    write = Call(lambda: ClaimedBlob(head, decode_header(head), memoryview(slot)).write_to(tier, key.id))
    assert hold.entered.wait(10)  # hashed, about to be copied
    slot[:64] = bytes(64)  # the sender writes into its slot meanwhile
    hold.open()
    write.outcome(timeout_s=10)
    verify_blob(tier.read(key.id), key)  # raises PayloadChecksumMismatch on the bytes the sender changed
