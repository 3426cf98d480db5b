"""The connector's scheduler side over a real in-process Store, without a model: claims are
chunk-aligned past the local prefix and skip locally held blocks, lookups are idempotent
and pinned until loaded, saves cover prompt and output chunks, other namespaces miss, a
failing store turns the connector off with one log line; and its configuration errors."""

import logging
import socket

import pytest
import torch

from connector import ConnectorConfig, ConnectorConfigError, KVConnector
from connector.metadata import ConnectorOutput, LoadResult
from connector.tails import tail_key
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, config_from_dict, load_config
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store

BLOCK, CHUNK = 4, 16  # 4 blocks per chunk
FP32_NS = Namespace("sched-test", num_layers=2, num_kv_heads=2, head_dim=4, dtype="float32", chunk_tokens=CHUNK)
TOKENS = list(range(100, 100 + 6 * CHUNK + 5))  # 6 full chunks and a tail


@pytest.fixture
def store(tmp_path):
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20, page_bytes=4096),
                      disk=DiskTierConfig(path=str(tmp_path / "disk")))
    with Store(cfg) as s:
        yield s


def connector(store, ns=FP32_NS, **kw):
    return KVConnector(store, ns, BLOCK, ConnectorConfig(chunk_tokens=ns.chunk_tokens, **kw))


def request(tokens=TOKENS, request_id="r"):
    seq = Sequence(list(tokens), SamplingParams(max_tokens=4), arrival_time=0.0, request_id=request_id)
    seq.block_table = list(range(1000, 1000 + -(-len(tokens) // BLOCK)))
    return seq


def put_chunks(store, n, tokens=TOKENS, ns=FP32_NS):
    keys = chunk_keys(tokens, ns)[:n]
    for i, key in enumerate(keys):
        store.put(key, torch.full(ns.chunk_shape, float(i)), parent=keys[i - 1] if i else None)
    return keys


@pytest.mark.parametrize("local_blocks", [0, 1, 3, 4, 5, 8, 13])
def test_claims_are_chunk_aligned_past_the_local_prefix_and_skip_held_blocks(store, local_blocks):
    put_chunks(store, 4)
    conn = connector(store).scheduler
    seq = request()
    local = local_blocks * BLOCK
    tokens, asynchronous = conn.get_num_new_matched_tokens(seq, local)
    expected = max(0, 4 * CHUNK - local)
    assert (tokens, asynchronous) == (expected, False)
    conn.update_state_after_alloc(seq, tokens)
    plan = conn.build_connector_meta([])
    if not expected:
        assert plan.loads == []
        return
    (load,) = plan.loads
    assert load.first_chunk == local // CHUNK
    first = load.chunks[0]
    assert first.skip_blocks == local_blocks % (CHUNK // BLOCK)
    loaded_blocks = [b for c in load.chunks for b in c.block_ids]
    assert loaded_blocks == seq.block_table[local_blocks:4 * CHUNK // BLOCK]  # never a locally held block


def test_a_full_prompt_hit_is_reported_whole_the_engine_keeps_the_last_token(store):
    tokens = TOKENS[:3 * CHUNK]
    put_chunks(store, 3, tokens)
    assert connector(store).scheduler.get_num_new_matched_tokens(request(tokens), 0) == (3 * CHUNK, False)


def test_async_mode_says_so_only_for_a_hit(store):
    put_chunks(store, 2)
    conn = connector(store, load_mode="async").scheduler
    assert conn.get_num_new_matched_tokens(request(), 0) == (2 * CHUNK, True)
    assert conn.get_num_new_matched_tokens(request(TOKENS[::-1], "other"), 0) == (0, False)


def test_lookup_is_idempotent_until_allocation_and_pins_until_the_load_finished(store):
    keys = put_chunks(store, 3)
    kv = connector(store)
    conn, seq = kv.scheduler, request()
    for _ in range(3):  # admission failed twice: asked again, answered from the first lookup
        assert conn.get_num_new_matched_tokens(seq, 0) == (3 * CHUNK, False)
    assert kv.stats().lookups == 1
    assert store.stats().pinned == 3
    conn.update_state_after_alloc(seq, 3 * CHUNK)
    (load,) = conn.build_connector_meta([]).loads
    conn.update_connector_output(ConnectorOutput(loads=[LoadResult("r", 3, 3 * CHUNK, (), 0.0, 0)]))
    assert store.stats().pinned == 0 and len(conn.pins) == 0
    assert store.unpin(keys) == 0


def test_a_changed_local_prefix_is_looked_up_again(store):
    put_chunks(store, 3)
    kv = connector(store)
    seq = request()
    assert kv.scheduler.get_num_new_matched_tokens(seq, 0) == (3 * CHUNK, False)
    assert kv.scheduler.get_num_new_matched_tokens(seq, 2 * CHUNK) == (CHUNK, False)
    assert kv.stats().lookups == 2
    assert store.stats().pinned == 1  # only the chunk still to load


def test_pins_are_counted_per_request_because_the_store_counts_per_chunk(store):
    put_chunks(store, 2)
    conn = connector(store).scheduler
    a, b = request(request_id="a"), request(request_id="b")
    conn.get_num_new_matched_tokens(a, 0)
    conn.get_num_new_matched_tokens(b, 0)
    conn.request_finished(a)
    assert store.stats().pinned == 2  # b still needs them
    conn.on_preempt(b)
    assert store.stats().pinned == 0 and conn.num_tracked == 0


def test_saves_plan_each_newly_completed_chunk_of_prompt_and_output(store):
    conn = connector(store).scheduler
    seq = request(TOKENS[:CHUNK + 6])
    conn.get_num_new_matched_tokens(seq, 0)
    conn.update_state_after_alloc(seq, 0)
    plan = conn.build_connector_meta([(seq, 10)])  # chunked prefill: 10 of 22 tokens
    assert plan.saves == []
    seq.num_computed = 10
    (save,) = conn.build_connector_meta([(seq, 12)]).saves  # the prompt's first chunk completes, and its prefill
    full, tail = save.chunks  # ... so its tail (one full block past the chunk) is saved too
    assert full.block_ids == tuple(seq.block_table[:4]) and tail.block_ids == (seq.block_table[4],)
    assert full.key == chunk_keys(TOKENS, FP32_NS)[0] and full.parent is None
    assert tail.key == tail_key(FP32_NS, TOKENS, 1, BLOCK, full.key) and tail.parent == full.key
    seq.num_computed = len(seq)
    while len(seq) < 2 * CHUNK:  # decode: output tokens complete the second chunk
        seq.token_ids.append(7)
        seq.block_table = list(range(1000, 1000 + -(-len(seq) // BLOCK)))
        plan = conn.build_connector_meta([(seq, 1)])
        seq.num_computed += 1
    (save,) = plan.saves
    assert save.chunks[0].key == chunk_keys(seq.token_ids, FP32_NS)[1]
    assert save.chunks[0].parent == chunk_keys(TOKENS, FP32_NS)[0]


def test_chunks_loaded_from_the_store_are_not_saved_again_unless_their_load_failed(store):
    put_chunks(store, 2)
    conn = connector(store).scheduler
    seq = request(TOKENS[:3 * CHUNK])
    tokens, _ = conn.get_num_new_matched_tokens(seq, 0)
    conn.update_state_after_alloc(seq, tokens)
    (load,) = conn.build_connector_meta([]).loads
    seq.num_computed = 2 * CHUNK
    (save,) = conn.build_connector_meta([(seq, CHUNK)]).saves
    assert [c.key for c in save.chunks] == [chunk_keys(TOKENS, FP32_NS)[2]]
    failed = tuple(b for c in load.chunks[1:] for b in c.block_ids)
    conn.update_connector_output(ConnectorOutput(loads=[LoadResult("r", 1, CHUNK, failed, 0.0, 0)]))
    seq.num_computed = CHUNK  # the engine recomputes from the first failed block
    (save,) = conn.build_connector_meta([(seq, 2 * CHUNK)]).saves
    assert [c.key for c in save.chunks] == chunk_keys(TOKENS, FP32_NS)[1:3]


@pytest.mark.parametrize("change", [{"dtype": "float16"}, {"model_id": "another-model"}, {"tenant": "t2"},
                                    {"chunk_tokens": 2 * CHUNK}])
def test_another_namespace_claims_nothing(store, change):
    put_chunks(store, 4)
    fields = dict(model_id=FP32_NS.model_id, num_layers=FP32_NS.num_layers, num_kv_heads=FP32_NS.num_kv_heads,
                  head_dim=FP32_NS.head_dim, dtype=FP32_NS.dtype, chunk_tokens=FP32_NS.chunk_tokens)
    other = Namespace(**{**fields, **change})
    assert connector(store, other).scheduler.get_num_new_matched_tokens(request(), 0) == (0, False)


def test_a_dead_daemon_turns_the_connector_off_with_one_log_line(caplog):
    from kvstore.client import Client

    with socket.socket() as sock:  # a port nothing listens on any more: the daemon is dead
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = Client(f"127.0.0.1:{port}", timeout_s=2.0, retries=0)
    kv = connector(client, unavailable_backoff_s=3600)
    with caplog.at_level(logging.WARNING, logger="connector"):
        for i in range(5):
            assert kv.scheduler.get_num_new_matched_tokens(request(request_id=str(i)), 0) == (0, False)
    lines = [r for r in caplog.records if r.name == "connector"]
    assert len(lines) == 1 and "store unavailable (pin_leading: DaemonError: UNAVAILABLE" in lines[0].getMessage()
    assert kv.stats().outages == 1 and kv.stats().lookups == 1  # off: later requests do not ask
    client.close()


def test_the_connector_comes_back_after_its_back_off(store):
    now = [0.0]
    kv = KVConnector(store, FP32_NS, BLOCK, ConnectorConfig(chunk_tokens=CHUNK, unavailable_backoff_s=10),
                     clock=lambda: now[0])
    kv.availability.failed("lookup", OSError("gone"))
    put_chunks(store, 1)
    assert kv.scheduler.get_num_new_matched_tokens(request(), 0) == (0, False)
    now[0] = 11.0
    assert kv.scheduler.get_num_new_matched_tokens(request(request_id="later"), 0) == (CHUNK, False)


@pytest.mark.parametrize("change, message", [
    ({"backend": "redis"}, "connector.backend: unknown value 'redis'; known: auto, store, daemon"),
    ({"load_mode": "eager"}, "connector.load_mode: unknown value 'eager'; known: sync, async, layerwise"),
    ({"chunk_tokens": 0}, "connector.chunk_tokens must be positive, got 0"),
    ({"load_timeout_s": 0.0}, "connector.load_timeout_s must be positive, got 0.0"),
])
def test_configuration_errors_are_one_line(change, message):
    with pytest.raises(ConnectorConfigError) as info:
        ConnectorConfig(**change)
    assert str(info.value) == message


def test_a_chunk_that_is_not_whole_blocks_is_refused_at_start(store):
    from engine.config import EngineConfig

    with pytest.raises(ConnectorConfigError, match="^connector.chunk_tokens 24 is not a multiple of the engine "
                                                   "block size 16$"):
        EngineConfig(block_size=16, connector=ConnectorConfig(chunk_tokens=24))
    with pytest.raises(ConnectorConfigError, match="not a multiple"):
        KVConnector(store, FP32_NS, 5, ConnectorConfig(chunk_tokens=CHUNK))


def test_the_configuration_loads_from_toml_with_the_store_as_a_subtree(tmp_path):
    path = tmp_path / "connector.toml"
    path.write_text('backend = "daemon"\nload_mode = "async"\nchunk_tokens = 64\n'
                    '[daemon]\naddr = "127.0.0.1:7000"\ntransport = "remote"\n'
                    '[store.host]\ncapacity_bytes = "1GiB"\n')
    cfg = load_config(path, ConnectorConfig)
    assert (cfg.backend, cfg.load_mode, cfg.chunk_tokens) == ("daemon", "async", 64)
    assert cfg.daemon.transport == "remote" and cfg.store.host.capacity_bytes == 1 << 30
    with pytest.raises(ConnectorConfigError, match="connector.daemon.transport: unknown value 'udp'"):
        config_from_dict({"daemon": {"transport": "udp"}}, ConnectorConfig)


def test_a_hit_pins_only_its_leading_chunks_and_the_request_unpins_them(store):
    """The hit is found and pinned in one store call (``pin_leading``): with the second of 3
    chunks gone, the first is the hit and the only chunk pinned, and it is unpinned when the
    request ends. (Looked up, then pinned, a chunk that left in between shrank the claim
    while the chunks past it stayed pinned after the request ended.)"""
    keys = put_chunks(store, 3)
    store.delete([keys[1]])
    conn = connector(store).scheduler
    seq = request()
    assert conn.get_num_new_matched_tokens(seq, 0) == (CHUNK, False)
    assert store.stats().pinned == 1
    conn.request_finished(seq)
    assert store.stats().pinned == 0 and len(conn.pins) == 0


def put_tail(store, tokens, blocks, ns=FP32_NS):
    """The tail of ``tokens``' first ``blocks`` blocks past their last full chunk, as the worker saves it."""
    full = len(tokens) // CHUNK
    keys = chunk_keys(tokens, ns)
    key = tail_key(ns, tokens, full, blocks * BLOCK, keys[full - 1] if full else None)
    store.put(key, torch.full(ns.chunk_shape, -1.0), parent=keys[full - 1] if full else None)
    return key


@pytest.mark.parametrize("stored_blocks", [1, 3])
def test_a_hit_on_every_full_chunk_also_loads_the_longest_stored_prompt_tail(store, stored_blocks):
    """A prompt of 2 chunks + 14 tokens (3 full blocks past them): a stored tail of its own 3
    blocks, or an earlier turn's shorter one, is loaded after the chunks, leaving the rest."""
    tokens = TOKENS[:2 * CHUNK + 14]
    put_chunks(store, 2, tokens)
    key = put_tail(store, tokens[:2 * CHUNK + stored_blocks * BLOCK], stored_blocks)
    if stored_blocks == 3:
        put_tail(store, tokens[:2 * CHUNK + 2 * BLOCK], 2)  # shorter: not chosen
    conn = connector(store).scheduler
    seq = request(tokens)
    matched, _ = conn.get_num_new_matched_tokens(seq, 0)
    assert matched == 2 * CHUNK + stored_blocks * BLOCK
    conn.update_state_after_alloc(seq, matched)
    (load,) = conn.build_connector_meta([]).loads
    assert [c.key for c in load.chunks] == chunk_keys(tokens, FP32_NS)[:2] + [key]
    assert load.chunks[-1].block_ids == tuple(seq.block_table[8:8 + stored_blocks])


def test_a_prompt_tail_is_not_looked_up_past_a_missing_chunk_nor_for_other_tokens(store):
    tokens = TOKENS[:2 * CHUNK + 14]
    put_chunks(store, 1, tokens)
    put_tail(store, tokens, 3)  # its second chunk is missing: the tail cannot be reached
    conn = connector(store).scheduler
    assert conn.get_num_new_matched_tokens(request(tokens), 0)[0] == CHUNK
    put_chunks(store, 2, tokens)
    other = tokens[:2 * CHUNK + 4] + [5] * 10  # the same chunks, other tokens in the tail's second block
    assert conn.get_num_new_matched_tokens(request(other, "o"), 0)[0] == 2 * CHUNK
    assert conn.get_num_new_matched_tokens(request(tokens, "t"), 0)[0] == 2 * CHUNK + 3 * BLOCK
