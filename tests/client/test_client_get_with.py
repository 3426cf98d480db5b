"""``Client.get_with``: chunks handed to a callback as read-only tensors (on the daemon's host,
straight over its mapped host pool), in order, up to the first miss or the first refusal; and
``Lender``'s placing of pool ranges that are one piece, split over pages, or in a slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_daemon import start_daemon
from kvstore._proto import kvstore_pb2 as pb
from kvstore.client import Client
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


def test_merged_runs_joins_adjacent_pages():
    assert merged_runs([0, 4096, 4096, 4096, 16384, 100]) == [(0, 8192), (16384, 100)]
    assert merged_runs([]) == []
