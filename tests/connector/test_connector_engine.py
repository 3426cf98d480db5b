"""The engine with the connector over a real in-process Store, on a tiny random checkpoint and
on the real SmolLM2-135M: greedy outputs equal the engine's without a store, and the books
balance after every step (blocks, queues, pins). Scenarios: full-prompt and partial hits in
every load mode, a hit overlapping blocks another request holds, an asynchronous load that
others run past, chunked prefill, preemption and resume, a corrupt chunk, a timed-out load,
a new engine process loading from the disk tier, saves dropped when the saver falls behind."""

import contextlib
import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from connector import ConnectorConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.assets import smollm2_gguf_path
from engine.sequence import Status
from engine.testing import make_tiny_checkpoint
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import chunk_keys
from kvstore.store import Store
from real_models import smollm2

MODES = ["sync", "async", "layerwise"]
GREEDY = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
PROSE = (Path(__file__).parents[2] / "bench" / "data" / "probe_prose.txt").read_text()


@dataclass
class Model:
    """An engine on one checkpoint, its block and chunk sizes, and prompts cut from real prose:
    exactly three chunks (a full-prompt hit), two chunks and a tail, less than a chunk."""

    llm: LLM
    path: Path
    block: int
    chunk: int

    def __post_init__(self) -> None:
        tokens = self.llm.tokenizer.encode(PROSE)
        c = self.chunk
        self.tokens = tokens
        self.prompts = [tokens[:3 * c], tokens[200:200 + 2 * c + 7], tokens[400:400 + c - 3]]

    def stored(self, num_tokens: int) -> int:
        """Tokens of a prompt of ``num_tokens`` the store holds once it was run: its full chunks
        and its tail of whole blocks (connector/tails.py)."""
        return num_tokens // self.block * self.block

    @property
    def chunk_bytes(self) -> int:
        cfg = self.llm.model_config
        return cfg.num_layers * 2 * self.chunk * cfg.num_kv_heads * cfg.head_dim * 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request, tmp_path_factory):
    if request.param == "tiny":
        path = make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", "llama")
        return Model(LLM(path, EngineConfig(num_blocks=96, block_size=4)), path, block=4, chunk=16)
    return Model(smollm2(num_blocks=64), smollm2_gguf_path(), block=16, chunk=32)


def on_both_models(name, values, real):
    """Parametrise ``model`` and ``name``: every value on the tiny checkpoint (the code paths,
    in milliseconds), and ``real`` on SmolLM2 too. The values run the same numerics; what real
    weights add (about 10 s a case) one case per test shows, the paths the tiny runs cover."""
    cases = [("tiny", v) for v in values] + [("smollm2", real)]
    return pytest.mark.parametrize(("model", name), cases, indirect=["model"])


def store_config(path, **disk):
    return StoreConfig(host=HostTierConfig(capacity_bytes=64 << 20, page_bytes=64 << 10),
                       disk=DiskTierConfig(path=str(path), capacity_bytes=256 << 20, **disk))


@pytest.fixture
def store(tmp_path):
    with Store(store_config(tmp_path / "disk")) as s:
        yield s


def with_store(model, store, engine=None, **connector):
    """An engine on the model's weights whose connector uses ``store`` (a fresh local prefix cache)."""
    connector.setdefault("chunk_tokens", model.chunk)
    return model.llm.with_config(kv_store=store, **(engine or {}), connector=ConnectorConfig(**connector))


def run(llm, prompts, params=GREEDY):
    """Greedy outputs, checking the scheduler's books after every step."""
    seqs = [llm.add_request(p, params) for p in prompts]
    while llm.has_unfinished():
        llm.step()
        llm.scheduler.check_integrity()
    return [s.output_token_ids for s in seqs], seqs


def baseline(model, prompts, params=GREEDY, **engine):
    return run(model.llm.with_config(**engine), prompts, params)[0]


def settle(llm, store):
    """Saves are in the store, nothing is pinned, nothing is tracked; the engine is closed."""
    assert llm.flush_saves()
    llm.scheduler.check_integrity()
    assert store.stats().pinned == 0
    llm.close()


@on_both_models("mode", MODES, real="layerwise")  # real: KV loaded layer by layer under the forward
def test_outputs_equal_without_a_store_cold_and_warm(model, store, mode):
    c = model.chunk
    want = baseline(model, model.prompts)
    cold = with_store(model, store, load_mode=mode)
    assert run(cold, model.prompts)[0] == want
    settle(cold, store)
    warm = with_store(model, store, load_mode=mode)  # a fresh engine: empty local prefix cache
    got, seqs = run(warm, model.prompts)
    assert got == want
    full, partial, short = (s.metrics for s in seqs)
    assert (full.num_loaded_tokens, full.num_prefilled_tokens) == (3 * c, 1)  # the last token is computed
    for m in (partial, short):  # past the full chunks, the prompt's tail of whole blocks is loaded too
        loaded = model.stored(m.num_prompt_tokens)
        assert (m.num_loaded_tokens, m.num_prefilled_tokens) == (loaded, m.num_prompt_tokens - loaded)
    assert full.kv_load_s > 0
    settle(warm, store)
    stats = warm.stats()
    assert stats.loaded_tokens == sum(model.stored(len(p)) for p in model.prompts)
    assert stats.connector.loaded_chunks == 5 + (7 >= model.block) + (c - 3 >= model.block)
    assert stats.connector.failed_loads == 0


def test_an_asynchronous_load_waits_while_other_requests_run(model, tmp_path):
    """A slow disk (two chunks a second) holds the first request's chunks: it waits for its KV
    while a second request runs; a third with the same prompt gets no local hit on the blocks
    still being loaded."""
    prompt, other_prompt = model.prompts[1], model.prompts[2]
    with Store(store_config(tmp_path / "disk")) as store:
        cold = with_store(model, store)
        want = run(cold, [prompt])[0]
        settle(cold, store)
    with Store(store_config(tmp_path / "disk", read_bytes_per_s=2 * model.chunk_bytes)) as slow:  # host RAM empty
        llm = with_store(model, slow, load_mode="async")
        loading = llm.add_request(prompt, GREEDY)
        other = llm.add_request(other_prompt, GREEDY)
        llm.step()
        assert loading.status is Status.WAITING_FOR_KV and other.status is Status.RUNNING
        twin = llm.add_request(prompt, GREEDY)
        ran_while_waiting = 0
        while llm.has_unfinished():
            waiting = loading.status is Status.WAITING_FOR_KV
            outputs = llm.step()
            ran_while_waiting += waiting and any(o.request_id == other.request_id for o in outputs)
            llm.scheduler.check_integrity()
        assert twin.metrics.num_cached_tokens == 0  # the loading request's blocks were not published
        assert ran_while_waiting > 0
        assert loading.output_token_ids == twin.output_token_ids == want[0]
        assert loading.metrics.num_loaded_tokens == model.stored(len(prompt))
        settle(llm, slow)


@on_both_models("mode", MODES, real="async")  # real: the skipped block's KV stays the holder's
def test_a_hit_that_overlaps_blocks_another_request_holds_writes_only_its_own(model, store, mode):
    """The store holds three chunks of a prompt; another running request holds its first
    chunk and one block more. The load skips that block of chunk 1 and writes only blocks
    with a single holder; the shared ones keep their bytes."""
    c, b = model.chunk, model.block
    prompt = model.prompts[0] + model.tokens[900:903]
    want = baseline(model, [prompt])
    cold = with_store(model, store)
    run(cold, [prompt])
    settle(cold, store)
    llm = with_store(model, store, load_mode=mode)
    holder = llm.add_request(prompt[:c + b + 2], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    while holder.num_computed < c + b + 2:  # its prompt in place and its full blocks published
        llm.step()
    shared = holder.block_table[:(c + b) // b]
    before = llm.runner.kv_cache[:, :, shared].clone()
    bm, worker = llm.block_manager, llm.connector.worker
    start = worker.start_load_kv

    def checked(plan):
        for load in plan.loads:
            assert load.first_chunk == 1 and load.chunks[0].skip_blocks == 1
            assert all(bm.blocks[i].ref_count == 1 for chunk in load.chunks for i in chunk.block_ids)
        start(plan)

    worker.start_load_kv = checked
    got, seqs = run(llm, [prompt])
    assert got == want
    assert seqs[0].metrics.num_cached_tokens == c + b and seqs[0].metrics.num_loaded_tokens == 2 * c - b
    assert torch.equal(llm.runner.kv_cache[:, :, shared], before)
    settle(llm, store)


def test_chunked_prefill_saves_only_computed_chunks(model, store):
    prompt = model.prompts[0] + model.prompts[1]
    budget = model.chunk // 2 - 2  # several steps per chunk, never aligned with one
    want = baseline(model, [prompt], max_num_batched_tokens=budget)
    llm = with_store(model, store, engine={"max_num_batched_tokens": budget})
    seq = llm.add_request(prompt, GREEDY)
    while not seq.is_finished:
        llm.step()
        assert llm.flush_saves()
        computed = len(seq) - 1 if seq.is_finished else seq.num_computed
        assert store.lookup(chunk_keys(seq.token_ids, llm.connector.namespace)) == computed // model.chunk
    assert seq.output_token_ids == want[0]
    settle(llm, store)
    warm = with_store(model, store, engine={"max_num_batched_tokens": budget})
    assert run(warm, [prompt])[0] == want
    settle(warm, store)


def test_preempted_requests_resume_from_the_store(model, store):
    """Too few blocks for three growing requests: some are preempted, and on resume their
    prompt and output chunks come back from the store."""
    c, b = model.chunk, model.block
    prompts = [model.tokens[100 * i:100 * i + c + 7] for i in range(3)]
    params = SamplingParams(max_tokens=c, temperature=0, ignore_eos=True)
    engine = {"num_blocks": 3 * (c + c // 2) // b + 2, "admission_watermark": 0.0}
    want = baseline(model, prompts, params, **engine)
    llm = with_store(model, store, engine=engine)
    got, seqs = run(llm, prompts, params)
    assert got == want
    resumed = [s for s in seqs if s.metrics.num_preemptions]
    assert resumed and any(s.metrics.num_loaded_tokens for s in resumed)
    settle(llm, store)


def cold_run_on_disk(model, path, prompt):
    """Run ``prompt`` through an engine that saves into a Store on ``path``, then close it:
    its chunks stay on the disk tier. Returns the outputs and the prompt's chunk keys."""
    with Store(store_config(path)) as store:
        cold = with_store(model, store)
        want = run(cold, [prompt])[0]
        settle(cold, store)
        return want, chunk_keys(prompt, cold.connector.namespace), store.tiers[1]


def warm_run_from_disk(model, path, prompt, want, read_bytes_per_s=0, **connector):
    """A new Store on ``path`` (host RAM empty, the chunks on disk) and a fresh engine."""
    with Store(store_config(path, read_bytes_per_s=read_bytes_per_s)) as store:
        llm = with_store(model, store, **connector)
        got, (seq,) = run(llm, [prompt])
        assert got == want
        settle(llm, store)
        return seq, llm.stats().connector, store.stats()


def test_a_corrupt_chunk_is_a_miss_and_its_blocks_are_recomputed(model, tmp_path):
    prompt = model.prompts[0] + model.tokens[900:901]
    want, keys, disk = cold_run_on_disk(model, tmp_path / "disk", prompt)
    path = disk.path_of(keys[1].id)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # a flipped payload byte: the checksum no longer matches
    path.write_bytes(bytes(data))
    seq, stats, store_stats = warm_run_from_disk(model, tmp_path / "disk", prompt, want)
    assert seq.metrics.num_loaded_tokens == model.chunk  # chunk 0; chunks 1 and 2 recomputed
    assert stats.failed_loads == 1 and store_stats.tiers["disk"].corruptions == 1


def test_a_load_past_its_deadline_is_recomputed(model, tmp_path):
    prompt = model.prompts[0] + model.tokens[900:901]
    want, _, _ = cold_run_on_disk(model, tmp_path / "disk", prompt)
    seq, stats, _ = warm_run_from_disk(model, tmp_path / "disk", prompt, want,
                                       read_bytes_per_s=2 * model.chunk_bytes, load_timeout_s=0.1)
    assert stats.timed_out_loads == 1
    assert seq.metrics.num_loaded_tokens < 3 * model.chunk


NEW_PROCESS = textwrap.dedent("""
    import json, sys
    from connector import ConnectorConfig
    from engine import LLM, EngineConfig, SamplingParams
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
    model, disk, block, chunk, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
    store = StoreConfig(host=HostTierConfig(capacity_bytes=64 << 20, page_bytes=64 << 10), disk=DiskTierConfig(path=disk))
    config = EngineConfig(num_blocks=64, block_size=block, dtype="float32",
                          connector=ConnectorConfig(store=store, chunk_tokens=chunk))
    with LLM(model, config) as llm:
        (out,) = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
        print(json.dumps({"tokens": out.output_token_ids, "loaded": out.metrics.num_loaded_tokens,
                          "tiers": {n: t.hits for n, t in llm.kv_store.stats().tiers.items()}}))
""")


def test_a_new_engine_process_loads_from_the_disk_tier(model, tmp_path):
    prompt = model.prompts[1]
    want, _, _ = cold_run_on_disk(model, tmp_path / "disk", prompt)
    root = str(Path(__file__).parents[2])
    result = subprocess.run([sys.executable, "-c", NEW_PROCESS, str(model.path), str(tmp_path / "disk"),
                             str(model.block), str(model.chunk), json.dumps(prompt)],
                            capture_output=True, text=True, timeout=300, cwd=root)
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["tokens"] == want[0]
    tail = 7 >= model.block  # the prompt's tail of whole blocks is a chunk blob of its own
    assert got["loaded"] == model.stored(len(prompt)) and got["tiers"]["disk"] == 2 + tail


def test_a_prompt_of_many_small_chunks_is_saved_whole_by_default(model, store):
    """The saves in flight are sized from the engine's step: a prompt whose one prefill step
    completes many more chunks than the old fixed 32 buffers is saved, not cut."""
    b, prompt = model.block, model.tokens[:40 * model.block + 3]
    llm = with_store(model, store, engine={"max_num_batched_tokens": 1024}, chunk_tokens=b)  # 40 chunks in one step
    run(llm, [prompt], SamplingParams(max_tokens=1, temperature=0))
    settle(llm, store)
    assert llm.stats().connector.dropped_saves == 0
    assert store.lookup(chunk_keys(prompt, llm.connector.namespace)) == 40


def test_saves_are_dropped_and_counted_when_the_saver_is_behind(model, store):
    """One save buffer: a step that completes three chunks of a request gathers one and drops
    the rest; outputs are unchanged and what was saved still loads."""
    want = baseline(model, model.prompts[:1])
    llm = with_store(model, store, max_pending_saves=1)
    assert run(llm, model.prompts[:1])[0] == want
    settle(llm, store)
    assert llm.stats().connector.dropped_saves == 2
    warm = with_store(model, store)
    got, (seq,) = run(warm, model.prompts[:1])
    assert got == want and seq.metrics.num_loaded_tokens == model.chunk
    settle(warm, store)


@on_both_models("dropped", [1, 2], real=1)  # real: lent, read and lent again, in one load
def test_a_load_borrows_what_host_ram_holds_and_reads_the_rest(model, store, dropped, monkeypatch):
    """Lent chunks are scattered in order on one thread; from the first group the store
    does not lend whole, the rest is read from disk through staging buffers, and the
    outputs are those of a cold run."""
    want = baseline(model, model.prompts[:1])
    cold = with_store(model, store)
    assert run(cold, model.prompts[:1])[0] == want
    settle(cold, store)
    keys = chunk_keys(model.prompts[0], cold.connector.namespace)
    assert store.drop([keys[dropped]], "host") == 1
    lent = []
    borrow = store.borrow

    @contextlib.contextmanager
    def counting_borrow(key):
        with borrow(key) as src:
            lent.append((keys.index(key), src is not None))
            yield src

    monkeypatch.setattr(store, "borrow", counting_borrow)
    warm = with_store(model, store, chunks_per_read=2)
    got, (seq,) = run(warm, model.prompts[:1])
    assert got == want and seq.metrics.num_loaded_tokens == 3 * model.chunk
    assert (dropped, False) in lent and all(ok for i, ok in lent if i != dropped)
    settle(warm, store)


@on_both_models("mode", ["sync", "async"], real="sync")  # real: the default load mode
def test_host_chunks_are_scattered_from_the_stores_pages(model, store, mode, monkeypatch):
    """Direct loads of raw chunks in host RAM borrow them (one copy into the blocks, no
    staging buffer, no get call), and the outputs are those of a cold run."""
    want = baseline(model, model.prompts)
    cold = with_store(model, store, load_mode=mode)
    assert run(cold, model.prompts)[0] == want
    settle(cold, store)
    lent, reads = [], []
    borrow = store.borrow

    def counting_borrow(key):
        class Lend:
            def __enter__(self):
                self.inner = borrow(key)
                src = self.inner.__enter__()
                lent.append(src is not None)
                return src

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)
        return Lend()

    monkeypatch.setattr(store, "borrow", counting_borrow)
    monkeypatch.setattr(store, "get_many_into", lambda *a, **k: reads.append(a) or 0)
    monkeypatch.setattr(store, "get_into", lambda *a, **k: reads.append(a) or False)
    warm = with_store(model, store, load_mode=mode)
    got, seqs = run(warm, model.prompts)
    assert got == want
    tails = (7 >= model.block) + (model.chunk - 3 >= model.block)  # the prompts' tails are lent too
    assert sum(lent) == 5 + tails and all(lent) and not reads
    settle(warm, store)
