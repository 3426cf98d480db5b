"""``Client.get_with``: chunks handed to a callback as read-only tensors (on the daemon's host,
straight over its mapped host pool), in order, up to the first miss or the first refusal, also
for chunks larger than a slot; and ``Lender``'s placing of pool ranges that are one piece,
split over pages, or in a slot, and of a Get without slots."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_daemon import start_daemon
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client import Client
from kvstore.client.bulk import BulkSession
from kvstore.client.placing import Lender, merged_runs
from kvstore.keys import ChunkKey, Namespace

PAGED_NS = Namespace("get-with-model", 2, 2, 64, dtype="float32", chunk_tokens=64)  # 64 KiB chunks: 16 pages of 4 KiB


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    proc = start_daemon(tmp_path_factory.mktemp("daemon"), slot_bytes="1MiB", page_bytes=4096)
    yield proc
    proc.stop()


def stored(client: Client, n: int, seed: int) -> tuple[list[ChunkKey], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    keys = [ChunkKey(PAGED_NS, bytes([seed, i]) * 8) for i in range(n)]
    data = [torch.randn(PAGED_NS.chunk_shape, generator=gen) for _ in keys]
    for key, kv in zip(keys, data):
        client.put(key, kv)
    return keys, data


@pytest.fixture(scope="module")
def small_slots(tmp_path_factory):
    proc = start_daemon(tmp_path_factory.mktemp("small-slots"), slot_bytes="16KiB", page_bytes=4096)
    yield proc
    proc.stop()


def socket_bytes(monkeypatch) -> list[int]:
    """The bytes every bulk session of this process receives into a chunk's place from now on."""
    got = []
    recv_into = BulkSession.recv_into

    def recorded(self, view):
        got.append(view.nbytes)
        return recv_into(self, view)

    monkeypatch.setattr(BulkSession, "recv_into", recorded)
    return got


@pytest.mark.parametrize("transport", ["shm", "remote"])
def test_every_chunk_is_handed_over_in_order_with_its_bytes(daemon, transport):
    with Client(daemon.addr, token_file=daemon.token_file, transport=transport) as client:
        keys, data = stored(client, 5, seed=1 if transport == "shm" else 2)
        seen = []
        taken = client.get_with(keys, lambda i, t: seen.append((i, t.clone())) or True)
    assert taken == 5 and [i for i, _ in seen] == list(range(5))
    for (_, got), want in zip(seen, data):
        assert torch.equal(got, want)


def test_a_miss_ends_the_prefix_and_a_refusal_stops_the_rest(daemon):
    with Client(daemon.addr, token_file=daemon.token_file) as client:
        keys, _ = stored(client, 3, seed=3)
        missing = ChunkKey(PAGED_NS, b"\xee" * 16)
        seen = []
        assert client.get_with([keys[0], missing, keys[2]], lambda i, t: seen.append(i) or True) == 1
        assert seen == [0]
        seen.clear()
        assert client.get_with(keys, lambda i, t: seen.append(i) or i < 1) == 1
        assert seen == [0, 1]  # the second was refused: not counted, and the third never offered


def test_lender_reads_one_piece_from_the_pool_and_gathers_a_split_one_into_its_slot():
    chunk = PAGED_NS.chunk_bytes
    values = np.arange(3 * chunk // 4, dtype=np.float32)
    pool = memoryview(values.tobytes())  # read-only, as the client maps the daemon's pool
    half = chunk // 2
    one_piece = pb.GetReply(index=0, chunk_bytes=chunk, pool_runs=[0, half, half, chunk - half])
    split = pb.GetReply(index=1, chunk_bytes=chunk, pool_runs=[2 * chunk, chunk - half, chunk, half])
    in_slot = pb.GetReply(index=2, chunk_bytes=chunk)
    slots = [memoryview(bytearray(chunk)) for _ in range(3)]
    slots[2][:] = pool[chunk:2 * chunk]
    seen = {}
    lender = Lender(PAGED_NS, lambda i, t: seen.setdefault(i, t.clone()) is not None)
    lender.lend_placed([(1, split, slots[1]), (0, one_piece, slots[0]), (2, in_slot, slots[2])], pool)
    flat = torch.from_numpy(values)
    per_chunk = chunk // 4
    assert lender.taken == 3
    assert torch.equal(seen[0].flatten(), flat[:per_chunk])
    tail = flat[2 * per_chunk: 2 * per_chunk + (chunk - half) // 4]
    assert torch.equal(seen[1].flatten(), torch.cat([tail, flat[per_chunk: per_chunk + half // 4]]))
    assert torch.equal(seen[2].flatten(), flat[per_chunk: 2 * per_chunk])


def read_both_ways(client: Client, keys, data) -> None:
    """``keys`` handed over in order and copied out, each equal to ``data``."""
    seen = []
    assert client.get_with(keys, lambda i, t: seen.append((i, t.clone())) or True) == len(keys)
    outs = [torch.empty(PAGED_NS.chunk_shape) for _ in keys]
    assert client.get_many_into(keys, outs) == len(keys)
    assert [i for i, _ in seen] == list(range(len(keys)))
    for (_, got), out, want in zip(seen, outs, data):
        assert torch.equal(got, want) and torch.equal(out, want)


def test_chunks_larger_than_a_slot_are_handed_over_from_the_pool_not_the_socket(small_slots, monkeypatch):
    """A chunk larger than the daemon's slots (64 KiB chunks, 16 KiB slots) is read straight
    out of the mapped pool, also by the copying reads; before, it came over the socket."""
    received = socket_bytes(monkeypatch)
    with Client(small_slots.addr, token_file=small_slots.token_file) as client:
        keys, data = stored(client, 4, seed=5)
        read_both_ways(client, keys, data)
        one = torch.empty(PAGED_NS.chunk_shape)
        assert client.get_into(keys[2], one) and torch.equal(one, data[2])
        missing = ChunkKey(PAGED_NS, b"\xee" * 16)
        assert client.get_with([keys[0], missing, keys[1]], lambda i, t: True) == 1
    assert received == []


def bytes_received_reading(tmp_path, monkeypatch, max_pinned_bytes: str, n: int, seed: int) -> list[int]:
    """Read ``n`` stored chunks both ways from a daemon with 16 KiB slots that pins at most
    ``max_pinned_bytes`` for a Get; the chunk bytes that came over the socket meanwhile."""
    daemon = start_daemon(tmp_path, slot_bytes="16KiB", extra_toml=f"[bulk]\nmax_pinned_bytes = {max_pinned_bytes}\n")
    try:
        with Client(daemon.addr, token_file=daemon.token_file) as client:
            keys, data = stored(client, n, seed=seed)
            received = socket_bytes(monkeypatch)
            read_both_ways(client, keys, data)
    finally:
        daemon.stop()
    return received


def test_a_get_larger_than_one_channel_pins_is_read_from_the_pool_in_parts(tmp_path, monkeypatch):
    """A channel pins at most ``bulk.max_pinned_bytes`` (here two 64 KiB chunks) for one Get
    and sends the rest as bytes; the client splits a Get without slots at that bound, so
    every chunk of six is read from the pool."""
    assert bytes_received_reading(tmp_path, monkeypatch, '"128KiB"', 6, seed=6) == []


def test_a_daemon_that_pins_nothing_for_a_get_sends_chunks_larger_than_a_slot_as_bytes(tmp_path, monkeypatch):
    """``bulk.max_pinned_bytes = 0`` (as a daemon from before pool views without slots tells
    it, which refuses them): the client asks for none, and every chunk comes over the socket."""
    assert bytes_received_reading(tmp_path, monkeypatch, "0", 3, seed=7) == [PAGED_NS.chunk_bytes] * 6


def test_lender_of_a_get_without_slots_takes_the_pool_or_the_bytes_in_order():
    chunk = PAGED_NS.chunk_bytes
    values = np.arange(chunk // 2, dtype=np.float32)  # two chunks' worth of pool
    pool = memoryview(values.tobytes())
    half = chunk // 2
    one_piece = pb.GetReply(index=0, chunk_bytes=chunk, pool_runs=[0, half, half, chunk - half], last=True)
    split = pb.GetReply(index=2, chunk_bytes=chunk, pool_runs=[chunk, half, 0, chunk - half], last=True)
    received = memoryview(bytearray(np.full(chunk // 4, 7, dtype=np.float32).tobytes()))
    seen = {}
    lender = Lender(PAGED_NS, lambda i, t: seen.setdefault(i, (t.clone(), t.data_ptr())) is not None)
    lender.lend_streamed([None, received, None, None], {0: one_piece, 2: split}, pool, base=0)
    flat = torch.from_numpy(values)
    per_chunk = chunk // 4
    assert sorted(seen) == [0, 1, 2] and lender.taken == 3  # the fourth never came: the prefix ends
    assert torch.equal(seen[0][0].flatten(), flat[:per_chunk])
    assert seen[0][1] == np.frombuffer(pool, dtype=np.uint8).ctypes.data  # in place, not copied
    assert torch.equal(seen[1][0].flatten(), torch.full((per_chunk,), 7.0))
    assert torch.equal(seen[2][0].flatten(), torch.cat([flat[per_chunk:per_chunk + per_chunk // 2], flat[:per_chunk // 2]]))


def test_merged_runs_joins_adjacent_pages():
    assert merged_runs([0, 4096, 4096, 4096, 16384, 100]) == [(0, 8192), (16384, 100)]
    assert merged_runs([]) == []
