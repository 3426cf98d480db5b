"""Agent sessions across tool calls (engine/sessions.py) on a real in-process Store, on a tiny
random checkpoint and on the real SmolLM2-135M: resumed turns produce a cold run's greedy
tokens under every policy and load mode, while other requests evict the paused session's
blocks; pins follow the stall and expire; nothing leaks (pins, holds, blocks, staging
buffers, tails); a session's tail is never loaded by another session or tenant; bad,
unknown, repeated and late events are no-ops."""

import math
import random
import time
from dataclasses import dataclass

import pytest

from connector import ConnectorConfig
from connector.sessions import SESSION_SALT
from engine import LLM, EngineConfig, SamplingParams
from engine.agent_config import AgentConfig
from engine.sessions import Residency
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.store import Store
from real_models import smollm2

GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Model:
    llm: LLM
    block: int
    chunk: int
    num_blocks: int  # a device budget the filler requests overflow

    def piece(self, start: int, n: int) -> list[int]:
        """``n`` token ids, the same for the same ``start``, others for others (seeded)."""
        rng = random.Random(start)
        return [rng.randrange(3, self.llm.model_config.vocab_size - 8) for _ in range(n)]


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request, tmp_path_factory):
    if request.param == "tiny":
        path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
        return Model(LLM(path, EngineConfig(num_blocks=96, block_size=4)), block=4, chunk=16, num_blocks=40)
    return Model(smollm2(num_blocks=64), block=16, chunk=32, num_blocks=24)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny1") / "llama", "llama")
    return Model(LLM(path, EngineConfig(num_blocks=96, block_size=4)), block=4, chunk=16, num_blocks=40)


@pytest.fixture
def store(tmp_path):
    cfg = StoreConfig(host=HostTierConfig(capacity_bytes=64 << 20, page_bytes=64 << 10),
                      disk=DiskTierConfig(path=str(tmp_path / "disk"), capacity_bytes=256 << 20))
    with Store(cfg) as s:
        yield s


def engine(model, store, policy="auto", load_mode="sync", tenant="", overrides=None, **agents):
    connector = None if store is None else ConnectorConfig(chunk_tokens=model.chunk, load_mode=load_mode,
                                                           tenant=tenant)
    return model.llm.with_config(kv_store=store, num_blocks=model.num_blocks, block_size=model.block,
                                 connector=connector, agents=AgentConfig(policy=policy, **agents), **(overrides or {}))


def drain(llm):
    while llm.has_unfinished():
        llm.step()
        llm.scheduler.check_integrity()


def turn(llm, prompt, session, **kw):
    seq = llm.add_request(prompt, GREEDY, session=session, **kw)
    drain(llm)
    return seq


def cold(model, prompt):
    return model.llm.with_config().generate([prompt], GREEDY)[0].output_token_ids


def evict(llm, model, start=3000):
    """Requests that take every block the paused session freed (the local prefix cache loses it)."""
    for i in range(3):
        llm.add_request(model.piece(start + 300 * i, (model.num_blocks - 4) * model.block // 2), GREEDY)
    drain(llm)


def kv_tokens(seq):
    return len(seq.token_ids) - 1  # the last sampled token never went through the model


def assert_idle(llm, store):
    """Nothing of any session left: holds, pins (ledger and store), tails, staging buffers, blocks."""
    assert llm.flush_saves()
    llm.scheduler.check_integrity()
    assert llm.scheduler.held == []
    assert llm.block_manager.num_free == len(llm.block_manager.blocks)
    if llm.connector is not None:
        assert len(llm.connector.scheduler.pins) == 0
        assert len(llm.connector.scheduler.tails) == 0
        assert llm.connector.worker.load_staging.outstanding == 0
        assert llm.connector.worker.save_staging.outstanding == 0
    if store is not None:
        assert store.stats().pinned == 0


# Every policy and load mode on the tiny checkpoint (the code paths); on SmolLM2 (about 11 s a
# case) offload with the default load mode: the one whose resumed turns load every block of the
# history back, chunks and tail, so real weights' numerics pass through the store.
@pytest.mark.parametrize("model,policy,load_mode", [
    *(("tiny", p, m) for p, m in [("offload", "sync"), ("offload", "async"), ("offload", "layerwise"),
                                  ("auto", "sync"), ("keep", "sync"), ("drop", "sync")]),
    ("smollm2", "offload", "sync")], indirect=["model"])
def test_resumed_turns_equal_a_cold_run(model, store, policy, load_mode):
    llm = engine(model, store, policy, load_mode)
    prompt = model.piece(0, 2 * model.chunk + model.block + 1)  # with 4 of 5 outputs: two chunks and a tail
    first = turn(llm, prompt, "a")
    assert first.output_token_ids == cold(model, prompt)
    assert llm.pause("a", expected_s=2.0, tool="search")
    llm.flush_saves()
    evict(llm, model)
    history = list(first.token_ids)
    for i in range(2):
        assert llm.resume_soon("a", eta_s=0.01)
        nxt = history + model.piece(1000 + 100 * i, 2 * model.block + 3)
        seq = turn(llm, nxt, "a")
        assert seq.output_token_ids == cold(model, nxt)
        m = seq.metrics
        reused = m.num_cached_tokens + m.num_loaded_tokens
        if policy == "offload":  # every full block of the history came back: the chunks and the tail
            assert reused == kv_tokens_of(history, model.block)
            assert m.num_loaded_tokens > 0
        history = list(seq.token_ids)
        llm.pause("a", expected_s=1.0)
        llm.flush_saves()
        evict(llm, model, start=4000 + 900 * i)
    assert llm.end_session("a")
    assert_idle(llm, store)
    llm.close()


def kv_tokens_of(history, block):
    """Tokens of ``history`` in full blocks that had KV (the last token never had)."""
    return (len(history) - 1) // block * block


def test_keep_holds_the_blocks_through_the_stall_and_offload_frees_them(tiny, store):
    prompt = tiny.piece(0, 2 * tiny.chunk + 5)
    for policy, held in (("keep", True), ("offload", False), ("drop", False)):
        llm = engine(tiny, store, policy)
        first = turn(llm, prompt, "a")
        free_before = llm.block_manager.num_free
        llm.pause("a", 5.0)
        llm.step()  # the decision is applied
        s = llm.sessions.sessions["a"]
        assert (s.hold is not None) is held
        assert (llm.block_manager.num_free == free_before) is held
        assert s.state is {"keep": Residency.KEPT, "offload": Residency.OFFLOADED, "drop": Residency.DROPPED}[policy]
        assert (store.stats().pinned > 0) is (policy in ("keep", "offload"))
        llm.flush_saves()
        llm.end_session("a")
        assert_idle(llm, store)
        llm.close()
        del first


def test_pins_follow_the_stall_and_expire(tiny, store):
    llm = engine(tiny, store, "offload", min_pin_s=0.3, max_pin_s=0.6, pin_factor=4.0)
    prompt = tiny.piece(0, 3 * tiny.chunk + 2 * tiny.block + 1)
    first = turn(llm, prompt, "a")
    started = time.monotonic()
    llm.pause("a", expected_s=0.1)  # 4 x 0.1 = 0.4 s, within [0.3, 0.6]
    llm.flush_saves()
    llm.step()  # retries pins of chunks still in the saver's queue
    s = llm.sessions.sessions["a"]
    assert s.pin_until - time.perf_counter() <= 0.4
    assert store.stats().pinned == 3 + 1  # three chunks and the tail
    while store.stats().pinned and time.monotonic() - started < 10:
        time.sleep(0.05)
    assert store.stats().pinned == 0
    assert time.monotonic() - started >= 0.35
    llm.step()  # the expired session is forgotten: its ledger entries and tail go
    assert "a" not in llm.sessions.sessions
    assert len(llm.connector.scheduler.pins) == 0
    assert len(llm.connector.scheduler.tails) == 0
    # a resume after the pins expired: whatever is still stored loads, the rest recomputes
    nxt = list(first.token_ids) + tiny.piece(900, 9)
    assert llm.resume_soon("a", 0.1) is False  # unknown now: a no-op
    evict(llm, tiny)
    assert turn(llm, nxt, "a").output_token_ids == cold(tiny, nxt)
    llm.end_session("a")
    assert_idle(llm, store)
    llm.close()


def test_a_kept_hold_ends_with_its_lease(tiny):
    llm = engine(tiny, None, "keep", min_pin_s=0.2, max_pin_s=0.3)
    turn(llm, tiny.piece(0, 2 * tiny.chunk + 5), "a")
    llm.pause("a", expected_s=0.05)
    llm.step()
    assert llm.sessions.sessions["a"].hold is not None
    deadline = time.monotonic() + 10
    while "a" in llm.sessions.sessions and time.monotonic() < deadline:
        time.sleep(0.05)
        llm.step()
    assert "a" not in llm.sessions.sessions
    assert_idle(llm, None)
    llm.close()


@pytest.mark.parametrize("expected", [60.0, 1e9])
def test_pin_ttl_is_clamped(tiny, store, expected):
    llm = engine(tiny, store, "offload")
    turn(llm, tiny.piece(0, 2 * tiny.chunk), "a")
    llm.pause("a", expected_s=expected)
    ttl = llm.sessions.sessions["a"].pin_until - time.perf_counter()
    assert ttl == pytest.approx(min(3600.0, 4 * expected), abs=1.0)
    llm.end_session("a")
    assert_idle(llm, store)
    llm.close()


def test_no_leaks_after_a_workload_of_interleaved_sessions(tiny, store):
    llm = engine(tiny, store, "auto", load_mode="async")
    histories = {f"s{i}": tiny.piece(37 * i, tiny.chunk + 7 * i + 3) for i in range(4)}
    for round_ in range(3):
        seqs = {s: llm.add_request(h, GREEDY, session=s) for s, h in histories.items()}
        drain(llm)
        for i, (s, seq) in enumerate(seqs.items()):
            assert seq.output_token_ids == cold(tiny, histories[s])
            histories[s] = list(seq.token_ids) + tiny.piece(2000 + 50 * i + 200 * round_, 5)
            [llm.pause, llm.resume_soon][i % 2](s, 0.5)
        llm.flush_saves()
    for s in histories:
        llm.end_session(s)
    assert_idle(llm, store)
    llm.close()


def test_the_tail_is_never_visible_to_another_session_or_tenant(tiny, store):
    prompt = tiny.piece(0, tiny.chunk + 2 * tiny.block + 1)  # with 4 of 5 outputs: a chunk and a 3-block tail
    a = engine(tiny, store, "offload")
    first = turn(a, prompt, "a")
    a.pause("a", 10.0)
    a.flush_saves()
    tail = a.connector.scheduler.tails.get("a")
    assert tail is not None and tail.num_blocks == 3
    assert SESSION_SALT + "a" in tail.key.namespace.tenant
    assert tail.key.namespace.fingerprint != a.connector.namespace.fingerprint
    assert store.contains(tail.key)
    history = list(first.token_ids)
    nxt = history + tiny.piece(700, 6)
    evict(a, tiny)
    # the same tokens in another session of the same engine: the chunk loads, the tail does not
    other = turn(a, nxt, "b")
    assert other.metrics.num_loaded_tokens + other.metrics.num_cached_tokens == tiny.chunk
    assert other.output_token_ids == cold(tiny, nxt)
    a.end_session("b")
    # the same session id under another tenant, on the same store: nothing at all
    b = engine(tiny, store, "offload", tenant="other")
    seq = turn(b, nxt, "a")
    assert seq.metrics.num_loaded_tokens == 0
    assert seq.output_token_ids == cold(tiny, nxt)
    b.end_session("a")
    assert_idle(b, None)  # engine a's paused session still holds its pins in the store
    b.close()
    # the session itself gets its tail
    evict(a, tiny, start=5000)
    nxt = history + tiny.piece(800, 6)  # not the chunk "b" saved
    mine = turn(a, nxt, "a")
    assert mine.metrics.num_loaded_tokens + mine.metrics.num_cached_tokens == tiny.chunk + 3 * tiny.block
    a.end_session("a")
    assert not store.contains(tail.key)  # an ended session's tail is deleted
    assert_idle(a, store)
    a.close()


def test_bad_unknown_repeated_and_late_events_are_no_ops(tiny, store):
    llm = engine(tiny, store, "auto", overrides=dict(max_num_batched_tokens=16))  # prefills over 3 steps
    assert llm.pause("nobody", 1.0) is False
    assert llm.resume_soon("nobody", 1.0) is False
    assert llm.end_session("nobody") is False
    prompt = tiny.piece(0, 2 * tiny.chunk + 9)
    seq = llm.add_request(prompt, GREEDY, session="a")
    llm.step()
    assert 0 < seq.num_computed < seq.num_prompt_tokens  # prefill under way
    assert llm.pause("a", 3.0) is True  # during the turn: applied when it ends
    assert llm.resume_soon("a", 1.0) is False  # its turn is running: nothing to bring back
    drain(llm)
    llm.step()
    s = llm.sessions.sessions["a"]
    assert s.decision is not None and s.stall_s == 3.0
    for bad in (-5.0, math.nan, math.inf, "soon", None, 1e12):
        assert llm.pause("a", bad) is True
        assert llm.resume_soon("a", bad) is True
        llm.step()
    assert store.stats().pinned <= 3  # repeated events never pin twice or anything else
    nxt = list(seq.token_ids) + tiny.piece(600, 7)
    evict(llm, tiny)
    assert turn(llm, nxt, "a").output_token_ids == cold(tiny, nxt)
    assert llm.end_session("a") is True
    assert llm.end_session("a") is False  # twice
    assert llm.pause("a", 1.0) is False  # after the end
    assert_idle(llm, store)
    llm.close()


def test_without_a_store_sessions_keep_or_drop(tiny):
    for policy in ("auto", "keep", "drop", "offload"):
        llm = engine(tiny, None, policy)
        prompt = tiny.piece(0, 2 * tiny.chunk + 5)
        seq = turn(llm, prompt, "a")
        llm.pause("a", 30.0)
        evict(llm, tiny)
        nxt = list(seq.token_ids) + tiny.piece(800, 5)
        assert turn(llm, nxt, "a").output_token_ids == cold(tiny, nxt)
        llm.end_session("a")
        assert_idle(llm, None)
        llm.close()


def test_keep_releases_held_blocks_only_when_nothing_else_could_run(tiny):
    llm = engine(tiny, None, "keep")
    prompt = tiny.piece(0, (tiny.num_blocks - 10) * tiny.block)  # the hold leaves 10 blocks
    turn(llm, prompt, "a")
    llm.pause("a", 100.0)
    small = llm.add_request(tiny.piece(2000, 5 * tiny.block), GREEDY)
    llm.step()
    assert llm.sessions.sessions["a"].hold is not None  # the small one fits beside it
    drain(llm)
    assert small.is_finished
    big = llm.add_request(tiny.piece(3000, 20 * tiny.block), GREEDY)
    drain(llm)  # it cannot fit while the hold stays: the hold goes (nothing else runs)
    assert big.is_finished and llm.sessions.counts["forced_releases"] == 1
    assert llm.sessions.sessions["a"].hold is None
    llm.end_session("a")
    assert_idle(llm, None)
    llm.close()


def test_a_request_that_outgrows_the_room_beside_a_kept_hold_finishes(tiny):
    """The hold leaves 10 blocks; a request fits there, then its decode needs an 11th. The
    step preempts it, its only running request, and admits nothing. Before the fix that step
    raised "waiting requests cannot be admitted into an empty KV cache"; the next step, with
    nothing running, releases the hold and the request resumes."""
    llm = engine(tiny, None, "keep")
    turn(llm, tiny.piece(0, (tiny.num_blocks - 10) * tiny.block), "a")
    llm.pause("a", 100.0)
    prompt = tiny.piece(5000, 9 * tiny.block - 1)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seq = llm.add_request(prompt, params)
    drain(llm)
    assert seq.metrics.num_preemptions == 1 and llm.sessions.counts["forced_releases"] == 1
    assert seq.output_token_ids == tiny.llm.with_config().generate([prompt], params)[0].output_token_ids
    llm.end_session("a")
    llm.close()


def test_auto_releases_kept_blocks_under_pressure(tiny, store):
    llm = engine(tiny, store, "auto", default_stall_s=1e-6)  # predicted stalls too short to offload
    seq = turn(llm, tiny.piece(0, (tiny.num_blocks - 10) * tiny.block), "a")
    llm.step()
    s = llm.sessions.sessions["a"]
    assert s.state is Residency.KEPT and s.hold is not None
    llm.flush_saves()
    other = turn(llm, tiny.piece(3000, 20 * tiny.block), "")  # needs the held blocks
    assert other.is_finished
    assert s.hold is None and s.state is Residency.OFFLOADED
    nxt = list(seq.token_ids) + tiny.piece(900, 5)
    assert turn(llm, nxt, "a").output_token_ids == cold(tiny, nxt)
    llm.end_session("a")
    assert_idle(llm, store)
    llm.close()


def test_paused_sessions_pin_at_most_half_the_host_ram_of_a_store_the_engine_builds(tiny, tmp_path):
    """Without ``agents.pin_budget_bytes``, an engine that builds its own Store bounds paused
    sessions' pins by half that Store's host RAM (read from the connector's config, not by
    reaching into it); on a store it is given, it sets no bound of its own."""
    host = HostTierConfig(capacity_bytes=32 << 20, page_bytes=64 << 10)
    built = ConnectorConfig(chunk_tokens=tiny.chunk, backend="store",
                            store=StoreConfig(host=host, disk=DiskTierConfig(path=str(tmp_path / "disk"),
                                                                             capacity_bytes=64 << 20)))
    llm = tiny.llm.with_config(num_blocks=tiny.num_blocks, block_size=tiny.block, connector=built)
    try:
        assert llm.sessions.pin_budget_bytes == 16 << 20
    finally:
        llm.close()
    cfg = StoreConfig(host=host, disk=DiskTierConfig(path=str(tmp_path / "given"), capacity_bytes=64 << 20))
    with Store(cfg) as given:
        other = engine(tiny, given)
        try:
            assert other.sessions.pin_budget_bytes is None
        finally:
            other.close()
