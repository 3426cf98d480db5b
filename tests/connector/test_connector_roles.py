"""The connector's producer and consumer roles, in-process: configuration mistakes, the
transfer codec's ranking (sink tokens on top), what a producer promises, and a consumer's
bounded wait for promised chunks."""

import pytest
import torch

from connector import ConnectorConfig, ConnectorConfigError
from connector.config import TransferConfig
from connector.roles import PromisedChunks, TransferCodecs, TransferParams
from engine import LLM, EngineConfig, SamplingParams
from engine.pd import RoleEngine
from engine.testing import make_tiny_checkpoint
from kvstore.codecs import codec_by_id, get_codec, resolve_codec
from kvstore.codecs.mixed import FULL, MixedPrecisionCodec, unpack_levels
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.disk import DiskTier
from faults import FaultyTier

pytestmark = pytest.mark.usefixtures("one_torch_thread")
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("kw, message", [
    ({"role": "prefill"}, "connector.role: unknown value 'prefill'"),
    ({"transfer": TransferConfig(codec="zstd")}, "connector.transfer.codec: unknown codec 'zstd'"),
    ({"transfer": TransferConfig(importance="mass")}, "connector.transfer.importance: unknown value"),
    ({"transfer": TransferConfig(wait_s=0)}, "connector.transfer.wait_s must be positive"),
    ({"transfer": TransferConfig(sink_tokens=-1)}, "connector.transfer.sink_tokens must not be negative"),
])
def test_bad_role_settings_are_one_line_errors(kw, message):
    with pytest.raises(ConnectorConfigError, match=message):
        ConnectorConfig(**kw)


def test_a_consumer_never_saves():
    assert ConnectorConfig().saves and ConnectorConfig(role="producer").saves
    assert not ConnectorConfig(role="consumer").saves and not ConnectorConfig(save=False).saves


def test_the_first_chunk_keeps_its_sink_tokens_at_full_precision():
    """mixed50 on an fp32 chunk keeps about a third of its rows full; the ranking puts the
    sinks first in a prompt's first chunk (whose large keys the key-norm ranking alone puts
    last, as it does in later chunks); recency ranks a chunk's last tokens first."""
    codecs = TransferCodecs(TransferConfig(codec="mixed50", sink_tokens=4))
    chunk = torch.randn(2, 2, 32, 2, 64)
    chunk[:, 0, :4] *= 50  # large keys: the key-norm ranking alone would put them last
    rows = 2 * 32
    first = unpack_levels(torch.frombuffer(bytearray(codecs.for_chunk(True).encode(chunk)[1:1 + rows // 4]),
                                           dtype=torch.uint8), rows).reshape(2, 32)
    rest = unpack_levels(torch.frombuffer(bytearray(codecs.for_chunk(False).encode(chunk)[1:1 + rows // 4]),
                                          dtype=torch.uint8), rows).reshape(2, 32)
    assert bool((first[:, :4] == FULL).all()) and not bool((rest[:, :4] == FULL).any())
    recency = TransferCodecs(TransferConfig(codec="mixed50", importance="recency", sink_tokens=0)).for_chunk(False)
    levels = unpack_levels(torch.frombuffer(bytearray(recency.encode(chunk)[1:1 + rows // 4]), dtype=torch.uint8),
                           rows).reshape(2, 32)
    assert bool((levels[:, -1] == FULL).all()) and not bool((levels[:, 0] == FULL).any())
    # every reader decodes it with the registered codec: the ranking is not in the format
    payload = codecs.for_chunk(True).encode(chunk)
    assert torch.equal(get_codec("mixed50").decode(payload, chunk.shape, chunk.dtype)[:, :, :4], chunk[:, :, :4])


def test_a_codec_instance_must_be_registered_under_its_name():
    assert resolve_codec(get_codec("mixed50").with_importance(lambda k: k[..., 0, 0])).name == "mixed50"
    with pytest.raises(ValueError, match="registered as 'mixed50'"):
        resolve_codec(MixedPrecisionCodec(0.3, "mixed30", 4))
    assert codec_by_id(6).name == "mixed25"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


def store():
    return Store(StoreConfig(host=HostTierConfig(capacity_bytes=64 << 20, page_bytes=16 << 10),
                             disk=DiskTierConfig(enabled=False)))


def test_a_producer_promises_only_chunks_the_store_holds(tiny):
    s = store()
    base = LLM(tiny, EngineConfig(num_blocks=128, block_size=4))
    producer = RoleEngine(base.with_config(kv_store=s, connector=ConnectorConfig(chunk_tokens=16, role="producer",
                          transfer=TransferConfig(codec="int8"))), "prefill")
    prompt = list(range(3, 60))
    producer.submit("a", prompt, GREEDY)
    done = []
    while not done:
        done = producer.step()
    t = done[0].transfer
    assert t.num_tokens == 48 and len(t.key_ids) == 3 and t.codec == "int8"
    assert t.first_token == base.generate(prompt, GREEDY)[0].output_token_ids[0]
    keys = chunk_keys(prompt, producer.llm.connector.namespace)
    assert [k.id.hex() for k in keys] == t.key_ids
    raw_bytes = torch.Size(producer.llm.connector.namespace.chunk_shape).numel() * 4
    assert len(s.get_blob(keys[0])) < 0.4 * raw_bytes  # put in int8 (head_dim 16: 20 of 64 bytes a row), not raw
    s.delete(keys[1:2])
    assert producer.llm.connector.worker.saver.promised(keys) == 1
    producer.llm.close()
    s.close()


def run_prefill(engine: RoleEngine, request_id: str, prompt: list[int]):
    engine.submit(request_id, prompt, GREEDY)
    for _ in range(200):
        for finished in engine.step():
            if finished.request_id == request_id:
                return finished
    raise AssertionError("the prefill did not finish")


def test_a_chunk_whose_durable_put_failed_is_never_promised(tiny, tmp_path):
    """The durable copy of a prompt's first chunk fails, so the first request's promise stops
    before it; its host-RAM copy stays in the store. Before the fix the saver forgot the lost
    chunk once a promise had asked about it, and the next request of the same prompt (a hit
    in its own KV cache: it saves nothing) promised it on the strength of ``lookup``: the
    decode engine then waited ``transfer.wait_s`` for a chunk the replica tier never got."""
    disk = FaultyTier(DiskTier(tmp_path / "disk", 1 << 24, name="disk"))
    with Store(StoreConfig(host=HostTierConfig(capacity_bytes=16 << 20, page_bytes=64 << 10),
                           disk=DiskTierConfig(enabled=False)), extra_tiers=[disk]) as s:
        llm = LLM(tiny, EngineConfig(num_blocks=64, block_size=4,
                                     connector=ConnectorConfig(chunk_tokens=16, role="producer")), kv_store=s)
        prefill = RoleEngine(llm, "prefill")
        prompt = list(range(10, 10 + 2 * 16 + 5))
        keys = chunk_keys(prompt, llm.connector.namespace)
        disk.failures["write"] = 1  # the durable copy of the first chunk fails
        assert run_prefill(prefill, "r1", prompt).transfer.key_ids == []
        assert s.lookup(keys[:1]) == 1 and disk.size_of(keys[0].id) is None
        promised = run_prefill(prefill, "r2", prompt).transfer.key_ids
        assert [k for k in promised if disk.size_of(bytes.fromhex(k)) is None] == []
        llm.close()


def test_a_consumer_waits_for_promised_chunks_within_its_bound():
    s = store()
    ns = Namespace("m", 2, 2, 16, "float32", 16)
    keys = chunk_keys(list(range(48)), ns)
    now = [0.0]
    params = TransferParams("r", [k.id.hex() for k in keys], 48)
    wait = PromisedChunks(s, keys, params, wait_s=5.0, clock=lambda: now[0])
    assert not wait.ready()
    for k in keys[:2]:
        s.put(k, torch.zeros(ns.chunk_shape))
    assert not wait.ready() and wait.visible == 2
    now[0] = 5.0
    assert wait.ready() and wait.timed_out
    s.put(keys[2], torch.zeros(ns.chunk_shape))
    assert PromisedChunks(s, keys, params, wait_s=5.0).ready()
    # another namespace's promise: nothing to wait for
    other = [k.id.hex() for k in chunk_keys(list(range(48)), Namespace("other", 2, 2, 16, "float32", 16))]
    mismatch = PromisedChunks(s, keys, TransferParams("r", other, 48), wait_s=5.0, clock=lambda: 0.0)
    assert mismatch.mismatched and mismatch.keys == [] and mismatch.ready() and not mismatch.timed_out
    s.close()


def test_observed_attention_is_the_causal_softmax_of_the_last_queries():
    from engine.attention import observed_mass

    q, k = torch.randn(4, 10, 16), torch.randn(30, 2, 16)
    expected = torch.zeros(30)
    heads = k.transpose(0, 1).repeat_interleave(2, 0)
    for h in range(4):
        for r in range(3):
            pos = 27 + r
            expected[:pos + 1] += ((q[h, 7 + r] @ heads[h, :pos + 1].T) * 0.25).softmax(-1)
    assert torch.allclose(observed_mass(q, k, 30, 3, 0.25), expected, atol=1e-5)


def test_an_attention_ranked_producer_puts_every_chunk_once_the_prompt_is_done(tiny):
    """Prefill in three steps (64-token budget): no chunk is put before the last step, which
    observes the prompt's attention; every full chunk is then ranked by it and promised."""
    s = store()
    base = LLM(tiny, EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=64))
    llm = base.with_config(kv_store=s, connector=ConnectorConfig(chunk_tokens=16, role="producer", transfer=TransferConfig(
        codec="mixed50", importance="attention", observe_tokens=8)))
    ranked = []
    saver = llm.connector.worker.saver
    rank = saver.rank
    saver.rank = lambda save, attention: (ranked.append((save.index, tuple(attention.shape), float(attention.sum()))),
                                          rank(save, attention))
    engine = RoleEngine(llm, "prefill")
    prompt = list(range(3, 150))
    engine.submit("a", prompt, GREEDY)
    puts = []
    done = []
    while not done:
        done = engine.step()
        puts.append(s.stats().puts)
    assert puts[0] == 0 and len(puts) == 3  # nothing put after the first two prefill steps
    assert [i for i, _, _ in ranked] == list(range(9)) and all(shape == (2, 16) for _, shape, _ in ranked)
    # 2 layers x 4 heads x 8 observed queries: the mass over the 147 tokens sums to 64
    assert 60 < sum(m for _, _, m in ranked) <= 64 + 1e-3
    assert done[0].transfer.num_tokens == 144 and done[0].token_ids == base.generate(prompt, GREEDY)[0].output_token_ids[:1]
    assert saver._attention == {}
    llm.close()
    s.close()


def test_only_a_mixed_codec_ranked_by_attention_defers_the_puts():
    ranked = TransferConfig(codec="mixed25", importance="attention")
    assert ranked.ranks_by_attention
    assert not TransferConfig(importance="attention").ranks_by_attention  # raw: nothing to rank
    assert not TransferConfig(codec="int8", importance="attention").ranks_by_attention
    assert not TransferConfig(codec="mixed25").ranks_by_attention
