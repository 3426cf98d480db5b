"""The engine with the connector over a real in-process Store, on a tiny random checkpoint:
greedy outputs equal the engine's without a store in every load mode, and the books balance
after every step (blocks, queues, pins). Scenarios: full and partial hits, a hit overlapping
blocks another request holds, an asynchronous load that others run past, chunked prefill,
preemption, a corrupt chunk, a timed-out load, saves dropped when the saver falls behind."""

import pytest
import torch

from connector import ConnectorConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.sequence import Status
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import chunk_keys
from kvstore.store import Store

BLOCK, CHUNK = 4, 16
MODES = ["sync", "async", "layerwise"]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPTS = [list(range(3, 3 + 3 * CHUNK)),  # exactly three chunks: a full-prompt hit
           list(range(40, 40 + 2 * CHUNK + 7)),  # two chunks and a tail
           list(range(90, 90 + CHUNK - 3))]  # shorter than a chunk: never stored


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")


@pytest.fixture(scope="module")
def base(tiny):
    return LLM(tiny, EngineConfig(num_blocks=96, block_size=BLOCK))


def store_config(path, **disk):
    return StoreConfig(host=HostTierConfig(capacity_bytes=8 << 20, page_bytes=4096),
                       disk=DiskTierConfig(path=str(path), capacity_bytes=64 << 20, **disk))


@pytest.fixture
def store(tmp_path):
    with Store(store_config(tmp_path / "disk")) as s:
        yield s


def with_store(base, store, engine=None, **connector):
    """An engine on ``base``'s weights whose connector uses ``store`` (a fresh local prefix cache)."""
    connector.setdefault("chunk_tokens", CHUNK)
    return base.with_config(kv_store=store, **(engine or {}), connector=ConnectorConfig(**connector))


def run(llm, prompts, params=GREEDY):
    """Greedy outputs, checking the scheduler's books after every step."""
    seqs = [llm.add_request(p, params) for p in prompts]
    while llm.has_unfinished():
        llm.step()
        llm.scheduler.check_integrity()
    return [s.output_token_ids for s in seqs], seqs


def baseline(base, prompts, params=GREEDY, **engine):
    return run(base.with_config(**engine), prompts, params)[0]


def settle(llm, store):
    """Saves are in the store, nothing is pinned, nothing is tracked; the engine is closed."""
    assert llm.flush_saves()
    llm.scheduler.check_integrity()
    assert store.stats().pinned == 0
    llm.close()


@pytest.mark.parametrize("mode", MODES)
def test_outputs_equal_without_a_store_cold_and_warm(base, store, mode):
    want = baseline(base, PROMPTS)
    cold = with_store(base, store, load_mode=mode)
    assert run(cold, PROMPTS)[0] == want
    settle(cold, store)
    warm = with_store(base, store, load_mode=mode)  # a fresh engine: empty local prefix cache
    got, seqs = run(warm, PROMPTS)
    assert got == want
    full, partial, short = (s.metrics for s in seqs)
    assert (full.num_loaded_tokens, full.num_prefilled_tokens) == (3 * CHUNK, 1)  # the last token is computed
    assert (partial.num_loaded_tokens, partial.num_prefilled_tokens) == (2 * CHUNK, 7)
    assert (short.num_loaded_tokens, short.num_prefilled_tokens) == (0, CHUNK - 3)
    assert full.kv_load_s > 0
    settle(warm, store)
    stats = warm.stats()
    assert stats.loaded_tokens == 5 * CHUNK and stats.connector.loaded_chunks == 5
    assert stats.connector.failed_loads == 0


def test_an_asynchronous_load_waits_while_other_requests_run(base, tmp_path):
    """A slow disk (4 KiB/s) holds the first request's chunks: it waits for its KV while a
    second request runs to completion; a third request with the same prompt gets no local
    hit on the blocks still being loaded."""
    prompt = PROMPTS[1]
    with Store(store_config(tmp_path / "disk")) as store:
        cold = with_store(base, store)
        want = run(cold, [prompt])[0]
        settle(cold, store)
    with Store(store_config(tmp_path / "disk", read_bytes_per_s=16 << 10)) as slow:  # host RAM empty
        llm = with_store(base, slow, load_mode="async")
        loading = llm.add_request(prompt, GREEDY)
        other = llm.add_request(PROMPTS[2], GREEDY)
        llm.step()
        assert loading.status is Status.WAITING_FOR_KV and other.status is Status.RUNNING
        twin = llm.add_request(prompt, GREEDY)
        llm.step()
        assert twin.metrics.num_cached_tokens == 0  # the loading request's blocks are not published yet
        while not other.is_finished:
            llm.step()
            llm.scheduler.check_integrity()
        assert loading.status is Status.WAITING_FOR_KV  # the others ran while it waited
        while llm.has_unfinished():
            llm.step()
            llm.scheduler.check_integrity()
        assert loading.output_token_ids == twin.output_token_ids == want[0]
        assert loading.metrics.num_loaded_tokens == 2 * CHUNK
        settle(llm, slow)


@pytest.mark.parametrize("mode", MODES)
def test_a_hit_that_overlaps_blocks_another_request_holds_writes_only_its_own(base, store, mode):
    """The store holds three chunks of a prompt; another running request holds its first 5
    blocks (20 tokens: one chunk and one block). The load skips that block of chunk 1 and
    writes only blocks with a single holder; the shared ones keep their bytes."""
    prompt = PROMPTS[0] + [7, 8, 9]
    want = baseline(base, [prompt])
    cold = with_store(base, store)
    run(cold, [prompt])
    settle(cold, store)
    llm = with_store(base, store, load_mode=mode)
    holder = llm.add_request(prompt[:22], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while holder.num_computed < 22:  # its prompt computed (or loaded) and its full blocks published
        llm.step()
    shared = holder.block_table[:5]
    before = llm.runner.kv_cache[:, :, shared].clone()
    bm, worker = llm.block_manager, llm.connector.worker
    start = worker.start_load_kv

    def checked(plan):
        for load in plan.loads:
            assert load.first_chunk == 1 and load.chunks[0].skip_blocks == 1
            assert all(bm.blocks[b].ref_count == 1 for c in load.chunks for b in c.block_ids)
        start(plan)

    worker.start_load_kv = checked
    got, seqs = run(llm, [prompt])
    assert got == want
    assert seqs[0].metrics.num_cached_tokens == 20 and seqs[0].metrics.num_loaded_tokens == 2 * CHUNK - 4
    assert torch.equal(llm.runner.kv_cache[:, :, shared], before)
    while llm.has_unfinished():
        llm.step()
    settle(llm, store)


def test_chunked_prefill_saves_only_computed_chunks(base, store):
    prompt = PROMPTS[0] + PROMPTS[1]
    want = baseline(base, [prompt], max_num_batched_tokens=6)
    llm = with_store(base, store, engine={"max_num_batched_tokens": 6})
    seq = llm.add_request(prompt, GREEDY)
    while not seq.is_finished:
        llm.step()
        assert llm.flush_saves()
        computed = len(seq) - 1 if seq.is_finished else seq.num_computed
        assert store.lookup(chunk_keys(seq.token_ids, llm.connector.namespace)) == computed // CHUNK
    assert seq.output_token_ids == want[0]
    warm = with_store(base, store, engine={"max_num_batched_tokens": 6})
    assert run(warm, [prompt])[0] == want
    settle(warm, store)


def test_preempted_requests_resume_from_the_store(base, store):
    """24 blocks of 4 tokens for three growing requests: some are preempted; on resume their
    prompt and output chunks come back from the store."""
    prompts = [list(range(10 + 7 * i, 10 + 7 * i + 30)) for i in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    engine = {"num_blocks": 24, "admission_watermark": 0.0}
    want = baseline(base, prompts, params, **engine)
    llm = with_store(base, store, engine=engine)
    got, seqs = run(llm, prompts, params)
    assert got == want
    resumed = [s for s in seqs if s.metrics.num_preemptions]
    assert resumed and any(s.metrics.num_loaded_tokens for s in resumed)
    settle(llm, store)


def reopened_warm_run(base, path, prompts, want, **disk_and_connector):
    disk = {k: disk_and_connector.pop(k) for k in list(disk_and_connector) if k == "read_bytes_per_s"}
    with Store(store_config(path, **disk)) as store:  # a new Store: host RAM empty, the chunks on disk
        llm = with_store(base, store, **disk_and_connector)
        got, seqs = run(llm, prompts)
        assert got == want
        settle(llm, store)
        return seqs, llm.stats().connector, store


def test_a_corrupt_chunk_is_a_miss_and_its_blocks_are_recomputed(base, tmp_path):
    prompt = PROMPTS[0] + [5]
    with Store(store_config(tmp_path / "disk")) as store:
        cold = with_store(base, store)
        want = run(cold, [prompt])[0]
        settle(cold, store)
        middle = chunk_keys(prompt, cold.connector.namespace)[1]
        path = store.tiers[1].path_of(middle.id)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a flipped payload byte: the checksum no longer matches
    path.write_bytes(bytes(data))
    (seq,), stats, store = reopened_warm_run(base, tmp_path / "disk", [prompt], want)
    assert seq.metrics.num_loaded_tokens == CHUNK  # chunk 0; chunks 1 and 2 recomputed
    assert stats.failed_loads == 1
    assert store.stats().tiers["nvme"].corruptions == 1


def test_a_load_past_its_deadline_is_recomputed(base, tmp_path):
    prompt = PROMPTS[0] + [5]
    with Store(store_config(tmp_path / "disk")) as store:
        cold = with_store(base, store)
        want = run(cold, [prompt])[0]
        settle(cold, store)
    (seq,), stats, _ = reopened_warm_run(base, tmp_path / "disk", [prompt], want,
                                         read_bytes_per_s=4 << 10, load_timeout_s=0.2)
    assert stats.timed_out_loads == 1
    assert seq.metrics.num_loaded_tokens < 3 * CHUNK


def test_saves_are_dropped_and_counted_when_the_saver_is_behind(base, store):
    """One save buffer: a step that completes three chunks of a request gathers one and drops
    the rest; outputs are unchanged and what was saved still loads."""
    want = baseline(base, PROMPTS[:1])
    llm = with_store(base, store, max_pending_saves=1)
    assert run(llm, PROMPTS[:1])[0] == want
    settle(llm, store)
    assert llm.stats().connector.dropped_saves == 2
    warm = with_store(base, store)
    got, (seq,) = run(warm, PROMPTS[:1])
    assert got == want and seq.metrics.num_loaded_tokens == CHUNK
    settle(warm, store)
