"""The store's half of a paused agent session, through the connector's face, over a real
in-process Store and no model: ``pause_session`` saves the tail and pins every chunk under
the session (a request's lookup ending never unpins them), reports pins that found a chunk
still in the saver's queue; ``unpin_session`` keeps the tail for the next turn;
``end_session`` deletes it; ``check_idle`` tells session pins from a request's."""

import pytest
import torch

from connector import ConnectorConfig, KVConnector
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from helpers import NS, store_config
from kvstore.keys import chunk_keys
from kvstore.store import Store

BLOCK = 4  # 2 blocks per chunk of NS
TOKENS = list(range(300, 300 + 3 * NS.chunk_tokens + BLOCK + 1))  # 3 full chunks, a one-block tail, a token
BLOCKS = list(range(-(-len(TOKENS) // BLOCK)))


@pytest.fixture
def store(tmp_path):
    with Store(store_config(tmp_path)) as s:
        yield s


@pytest.fixture
def conn(store):
    c = KVConnector(store, NS, BLOCK, ConnectorConfig(chunk_tokens=NS.chunk_tokens))
    kv_cache = torch.randn(NS.num_layers, 2, len(BLOCKS), BLOCK, NS.num_kv_heads, NS.head_dim).to(NS.torch_dtype)
    c.register_kv_cache(kv_cache, max_step_tokens=len(TOKENS))
    yield c
    c.close()


def put_full_chunks(store):
    keys = chunk_keys(TOKENS, NS)
    for i, key in enumerate(keys):
        store.put(key, torch.randn(NS.chunk_shape).to(NS.torch_dtype), parent=keys[i - 1] if i else None)
    return keys


def request(request_id="r"):
    seq = Sequence(list(TOKENS), SamplingParams(max_tokens=1), arrival_time=0.0, request_id=request_id)
    seq.block_table = list(BLOCKS)
    return seq


def test_a_pause_saves_the_tail_and_pins_every_chunk_under_the_session(store, conn):
    keys = put_full_chunks(store)
    pins = conn.pause_session("a", TOKENS, 60.0, BLOCKS)
    assert pins.applied and pins.tail_saved and pins.nbytes == 4 * NS.chunk_bytes
    assert conn.flush_saves()
    tail = conn.scheduler.tails.get("a").key
    assert store.lookup([tail]) == 1
    assert conn.pause_session("a", TOKENS, 60.0).missing == 0  # the tail is in the store now
    assert store.stats().pinned == 4
    conn.check_idle()  # a paused session's pins are no request's

    seq = request()
    assert conn.get_num_new_matched_tokens(seq, 0)[0] == len(keys) * NS.chunk_tokens
    with pytest.raises(AssertionError, match="tracks"):
        conn.check_idle()
    conn.request_finished(seq)
    conn.check_idle()
    assert store.stats().pinned == 4, "a request's lookup ending unpinned the session's chunks"

    conn.unpin_session("a")
    assert store.stats().pinned == 0
    assert store.lookup([tail]) == 1 and conn.scheduler.tails.get("a") is not None  # for the next turn
    conn.end_session("a")
    assert store.lookup([tail]) == 0 and conn.scheduler.tails.get("a") is None


def test_pins_that_find_no_chunk_yet_are_missing_and_a_later_pause_takes_them(store, conn):
    pins = conn.pause_session("a", TOKENS, 60.0)
    assert pins.applied and pins.missing == 3 and pins.nbytes == 3 * NS.chunk_bytes
    put_full_chunks(store)
    assert conn.pause_session("a", TOKENS, 60.0).missing == 0
    assert store.stats().pinned == 3
    conn.end_session("a")
    assert store.stats().pinned == 0


def test_nothing_to_pin_changes_nothing(store, conn):
    assert not conn.pause_session("a", TOKENS[:NS.chunk_tokens - 1], 60.0).applied  # no full chunk, no tail
    put_full_chunks(store)
    assert conn.pause_session("a", TOKENS, 60.0).applied
    lapsed = conn.pause_session("a", TOKENS, 0.0)  # a lease already over: a no-op
    assert not lapsed.applied and lapsed.nbytes == 3 * NS.chunk_bytes
    assert store.stats().pinned == 3
    conn.end_session("a")
