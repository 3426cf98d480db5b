"""A randomized differential test of the engine with the store: for random workloads, the
greedy tokens of an engine that loads and saves KV through the connector equal those of the
same weights with no store and no prefix cache, each prompt run alone (everything
recomputed). A KV cache that is sometimes wrong is worse than none, and the scenario tests
only check the cases someone thought of.

Each seed draws an engine and a store and runs rounds of requests over them:
- prompts that share prefixes with earlier prompts and outputs, cut on a chunk or block
  boundary, one token either side of one, or anywhere; repeated prompts; follow-up turns
  (an earlier prompt, its output and new tokens);
- a store whose host RAM holds a few chunks over a disk tier (evictions, cold reads,
  promotions), sometimes a small disk, random pages, codec (lossless), eviction policy and
  replication; chunks dropped from a tier or deleted between steps, so lookups, pins and
  loads meet chunks that left;
- a KV cache small enough to preempt, several requests in flight, requests arriving while
  others run, chunked prefill, prefix caching on and off, every load mode, a fresh engine
  (empty local prefix cache) on the same store between rounds.

The KV a forward computes is not bit-identical across batch shapes (chunked prefill moves
the last bits), so a loaded chunk is only ~1e-6 away from a recomputed one. Tokens are
compared exactly; where they part, the reference's logit gap between the two tokens must be
below ``TIE`` (a near tie that either answer is right for), else it is a failure.

CI runs a fixed set of seeds in well under a minute; ``pytest -m long`` runs
``KVSTORE_DIFF_EXAMPLES`` seeds (default 300) from ``KVSTORE_DIFF_SEED`` (default 1000)."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from dataclasses import dataclass, field
from unittest import mock

import pytest

import engine.llm
from connector import ConnectorConfig, DaemonBackendConfig
from engine import LLM, EngineConfig, SamplingParams
from engine.testing import NUM_BYTES
from kv_daemon import start_daemon
from kvstore.config import DiskTierConfig, HostTierConfig, ReplicationConfig, StoreConfig
from kvstore.keys import chunk_keys
from kvstore.policies import POLICIES
from kvstore.store import Store

MODES = ["sync", "async", "layerwise"]
TIE = 1e-4  # logit gap under which two greedy tokens are a tie (the KV's last bits decide)
CI_SEEDS = range(12)
DAEMON_SEEDS = range(100, 103)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    return LLM(tiny_llama, EngineConfig(num_blocks=8, block_size=4))


class Reference:
    """Greedy outputs of the engine without a store or a prefix cache, each prompt alone,
    with the gap between the best and second-best logit at every position (kept per prompt)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.with_config(connector=None, enable_prefix_caching=False, num_blocks=512, block_size=4,
                                      max_num_batched_tokens=1024)
        self.known: dict[tuple[int, ...], tuple[list[int], list[float]]] = {}

    def __call__(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
        tokens, gaps = self.known.get(tuple(prompt), ([], []))
        if len(tokens) < max_tokens:
            seen = []
            sample = engine.llm.sample

            def recording(logits, params, generator):
                top = logits.float().topk(2).values
                seen.append(float(top[0] - top[1]))
                return sample(logits, params, generator)

            with mock.patch.object(engine.llm, "sample", recording):
                (out,) = self.engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                       ignore_eos=True))
            tokens, gaps = out.output_token_ids, seen
            self.known[tuple(prompt)] = tokens, gaps
        return tokens[:max_tokens], gaps[:max_tokens]

    def logit_gap(self, prompt: list[int], a: int, b: int) -> float:
        """|logit(a) - logit(b)| for the token after ``prompt``."""
        logits = []
        sample = engine.llm.sample
        with mock.patch.object(engine.llm, "sample", lambda lg, p, g: logits.append(lg) or sample(lg, p, g)):
            self.engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        return abs(float(logits[0][a]) - float(logits[0][b]))


@pytest.fixture(scope="module")
def reference(tiny):
    ref = Reference(tiny)
    yield ref
    ref.engine.close()


@dataclass
class Case:
    """One seed's engine, store and workload, and the log a failure prints."""

    seed: int
    rng: random.Random
    block: int
    chunk: int
    longest: int  # prompt tokens at most
    most_out: int  # output tokens at most
    log: list[str] = field(default_factory=list)
    history: list[list[int]] = field(default_factory=list)  # prompts and prompts + outputs so far
    stats: dict[str, int] = field(default_factory=dict)

    def note(self, line: str) -> None:
        self.log.append(line)

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(NUM_BYTES) for _ in range(n)]

    def cut(self, length: int) -> int:
        """Where to cut an earlier sequence: on a chunk or block boundary, one token either
        side of one, or anywhere."""
        r, c, b = self.rng, self.chunk, self.block
        kind = r.choice(["chunk", "chunk-1", "chunk+1", "block", "block+1", "whole", "any"])
        if kind == "whole":
            return length
        if kind == "any":
            return r.randint(1, length)
        unit = c if kind.startswith("chunk") else b
        k = r.randint(1, max(1, length // unit))
        return max(1, min(length, k * unit + {"-1": -1, "+1": 1}.get(kind[-2:], 0)))

    def prompt(self) -> tuple[str, list[int]]:
        r = self.rng
        if not self.history or r.random() < 0.15:
            return "fresh", self.fresh(r.randint(1, self.longest))
        base = r.choice(self.history)
        kind = r.choice(["repeat", "prefix", "prefix", "extend"])
        if kind == "repeat":
            tokens = list(base)
        elif kind == "prefix":
            tokens = base[:self.cut(len(base))] + (self.fresh(r.randint(1, 2 * self.chunk)) if r.random() < 0.7 else [])
        else:  # a follow-up turn: the whole earlier sequence and more
            tokens = base + self.fresh(r.randint(1, self.chunk + 2))
        return kind, tokens[:self.longest]


def draw_engine(case: Case, num_blocks: int) -> dict:
    r = case.rng
    return dict(
        engine=dict(num_blocks=num_blocks, block_size=case.block,
                    enable_prefix_caching=r.random() < 0.6,
                    max_num_batched_tokens=r.choice([512, case.chunk // 2 + 1, case.block + 1, 3 * case.chunk - 1]),
                    max_num_seqs=r.choice([1, 2, 4, 8]), admission_watermark=r.choice([0.0, 0.01])),
        connector=dict(chunk_tokens=case.chunk, load_mode=r.choice(MODES), chunks_per_read=r.randint(1, 3),
                       load_workers=r.randint(1, 2), staging_chunks=r.choice([1, 4, 16]),
                       max_pending_saves=r.choice([1, 2, 32])),
    )


def draw_store(case: Case, root, chunk_bytes: int) -> StoreConfig:
    r = case.rng
    page = r.choice([4096, 8192])  # a 16-token chunk takes two 4 KiB pages (read staged, not lent)
    host_chunks = r.choice([2, 3, 5, 40])
    disk = r.choice([1 << 24, 6 * (chunk_bytes + 4096)])
    cfg = StoreConfig(
        host=HostTierConfig(capacity_bytes=host_chunks * -(-chunk_bytes // page) * page, page_bytes=page,
                            prefault=False),
        disk=DiskTierConfig(path=str(root / "disk"), capacity_bytes=disk, fetch_workers=2, read_threads=2),
        codec=r.choice(["raw", "raw", "lz4"]),
        eviction_policy=r.choice(["default", *sorted(POLICIES)]),
        replication=ReplicationConfig(mode=r.choice(["all", "utility"])),
        promote_on_read=r.random() < 0.8,
    )
    case.note(f"store: page {page}, host {host_chunks} chunks, disk {disk} B, codec {cfg.codec}, "
              f"eviction {cfg.eviction_policy}, replication {cfg.replication.mode}, promote {cfg.promote_on_read}")
    return cfg


def disturb(case: Case, store: Store, keys: list, p: float, when: str, ways=("host", "host", "disk", "delete")) -> None:
    """With probability ``p``: some of ``keys`` leave host RAM, the disk, or the store."""
    r = case.rng
    if not keys or r.random() >= p:
        return
    picked = r.sample(keys, r.randint(1, len(keys)))
    what = r.choice(ways) if isinstance(store, Store) else "delete"
    n = store.delete(picked) if what == "delete" else store.drop(picked, what)
    case.note(f"  {when}: {what} {[keys.index(k) for k in picked]} of {len(keys)} chunks ({n} there)")


def disturbing_loads(case: Case, llm: LLM, store: Store, p: float) -> None:
    """Chunks a step is about to load may leave between the lookup that found (and pinned)
    them and the load: the engine's worker starts each step's loads through this."""
    worker = llm.connector.worker
    start = worker.start_load_kv

    def start_load_kv(meta):
        disturb(case, store, [c.key for load in meta.loads for c in load.chunks], p, "before a load",
                ("host", "disk", "delete", "delete"))
        start(meta)

    worker.start_load_kv = start_load_kv


def check(case: Case, reference: Reference, prompt: list[int], got: list[int], max_tokens: int, what: str) -> None:
    want, gaps = reference(prompt, max_tokens)
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
    gap = reference.logit_gap(prompt + want[:i], got[i], want[i])
    case.stats["ties"] = case.stats.get("ties", 0) + 1
    assert gap < TIE, (f"seed {case.seed}: {what} (prompt {len(prompt)} tokens) differs from a cold run at "
                       f"output {i} (logit gap {gap:.3g}, best-second {gaps[i]:.3g}):\n  got  {got}\n  want {want}\n"
                       + "\n".join(case.log))


@contextlib.contextmanager
def racing(case: Case, store: Store, namespace, on: bool):
    """With ``on``: a thread that drops and deletes chunks of earlier sequences all along,
    racing the loader threads' reads and borrows (the outcome then varies run to run)."""
    if not on:
        yield
        return
    stop = threading.Event()
    rng = random.Random(case.seed + 1)

    def race():
        while not stop.wait(0.002):
            if case.history:
                keys = chunk_keys(rng.choice(case.history), namespace)
                if keys:
                    picked = rng.sample(keys, rng.randint(1, len(keys)))
                    what = rng.choice(["host", "host", "disk", "delete"])
                    store.delete(picked) if what == "delete" else store.drop(picked, what)

    thread = threading.Thread(target=race, name="diff-racer", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def run_case(seed: int, tiny: LLM, reference: Reference, root, daemon=None, race: bool = False) -> dict[str, int]:
    """One seed's rounds on an in-process Store, or, with ``daemon``, on engines that each
    open their own Client to it (chunks can then only be deleted, not dropped from a tier);
    with ``race`` a thread drops and deletes chunks all along (in-process only)."""
    rng = random.Random(seed)
    block = rng.choice([2, 4])
    chunk = block * rng.choice([1, 2, 4])
    if chunk < 4:
        chunk *= 2
    case = Case(seed, rng, block, chunk, longest=rng.choice([3, 5]) * chunk + 3, most_out=2 * chunk + 2)
    mc = tiny.model_config
    chunk_bytes = mc.num_layers * 2 * chunk * mc.num_kv_heads * mc.head_dim * 4
    need = -(-(case.longest + case.most_out) // block)  # one request alone always fits
    num_blocks = need + rng.choice([0, 1, need // 2, 3 * need])
    case.note(f"seed {seed}: block {block}, chunk {chunk}, KV cache {num_blocks} blocks ({need} for one request)")
    p_disturb, p_before_load = rng.choice([0.0, 0.1, 0.3]), rng.choice([0.0, 0.25, 0.5])
    totals: dict[str, int] = {}
    with contextlib.nullcontext() if daemon else Store(draw_store(case, root, chunk_bytes)) as in_process:
        llm = None
        for rnd in range(rng.randint(2, 6)):
            if llm is None or rng.random() < 0.5:
                if llm is not None:
                    settle(llm, totals)
                knobs = draw_engine(case, num_blocks)
                if daemon:
                    knobs["connector"].update(backend="daemon", daemon=DaemonBackendConfig(
                        addr=daemon.addr, transport=rng.choice(["shm", "remote"]), token_file=daemon.token_file))
                llm = tiny.with_config(kv_store=in_process, **knobs["engine"],
                                       connector=ConnectorConfig(**knobs["connector"]))
                store = llm.kv_store
                disturbing_loads(case, llm, store, p_before_load)
                case.note(f"engine: {knobs}")
            elif rng.random() < 0.5:
                llm.reset_prefix_cache()
                case.note("reset prefix cache")
            arrivals = []
            for _ in range(rng.randint(1, 8)):
                kind, prompt = case.prompt()
                max_tokens = rng.randint(1, case.most_out)
                arrivals.append((rng.choice([0, 0, 1, 2, 5]), kind, prompt, max_tokens))
            arrivals.sort(key=lambda a: a[0])
            case.note(f"round {rnd}: " + "; ".join(f"step {s} {k} {len(p)}+{m}" for s, k, p, m in arrivals))
            seqs = []
            with racing(case, store, llm.connector.namespace, race and not daemon):
                run_round(case, llm, store, arrivals, seqs, p_disturb)
            for kind, seq in seqs:
                check(case, reference, seq.prompt_token_ids, seq.output_token_ids, seq.params.max_tokens,
                      f"round {rnd} {kind} request")
                totals["preemptions"] = totals.get("preemptions", 0) + seq.metrics.num_preemptions
                case.history += [seq.prompt_token_ids, seq.token_ids]
            if rng.random() < 0.7:
                assert llm.flush_saves()
        settle(llm, totals)
    totals["ties"] = case.stats.get("ties", 0)
    return totals


def run_round(case: Case, llm: LLM, store, arrivals: list, seqs: list, p_disturb: float) -> None:
    """Step until every request of the round (added at its step) is finished."""
    step = 0
    while arrivals or llm.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, kind, prompt, max_tokens = arrivals.pop(0)
            seqs.append((kind, llm.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                      ignore_eos=True))))
        if llm.has_unfinished():
            llm.step()
            llm.scheduler.check_integrity()
        step += 1
        if case.history:
            disturb(case, store, chunk_keys(case.rng.choice(case.history), llm.connector.namespace), p_disturb,
                    f"after step {step}")


def settle(llm: LLM, totals: dict[str, int]) -> None:
    """Saves in the store, no request tracked, no pin held; the engine closed; its counters kept."""
    assert llm.flush_saves()
    llm.scheduler.check_integrity()
    assert llm.kv_store.stats().pinned == 0
    stats = llm.stats().connector
    for name in ("loaded_tokens", "failed_loads", "dropped_saves"):
        totals[name] = totals.get(name, 0) + getattr(stats, name)
    llm.close()


def run_seeds(seeds, tiny, reference, tmp_path, daemon=None, race=False) -> dict[str, int]:
    totals: dict[str, int] = {}
    for seed in seeds:
        for name, n in run_case(seed, tiny, reference, tmp_path / f"seed{seed}", daemon, race).items():
            totals[name] = totals.get(name, 0) + n
    return totals


def test_outputs_with_the_store_equal_a_cold_run(tiny, reference, tmp_path):
    """A fixed set of seeds; between them they load, fail loads, drop saves and preempt."""
    totals = run_seeds(CI_SEEDS, tiny, reference, tmp_path)
    print(totals)
    assert totals["loaded_tokens"] > 0 and totals["failed_loads"] > 0
    assert totals["dropped_saves"] > 0 and totals["preemptions"] > 0


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon whose host RAM holds eight 4 KiB pages, over a disk tier."""
    with start_daemon(tmp_path_factory.mktemp("diff-daemon"), host_bytes="32KiB", disk_bytes="1MiB") as proc:
        yield proc


def test_outputs_through_a_daemon_equal_a_cold_run(tiny, reference, daemon, tmp_path):
    """Fewer seeds: every engine opens a Client to a daemon process over shared memory or the
    remote path; the daemon is shared, so seeds also load each other's chunks."""
    totals = run_seeds(DAEMON_SEEDS, tiny, reference, tmp_path, daemon)
    print(totals)
    assert totals["loaded_tokens"] > 0


@pytest.mark.long
@pytest.mark.timeout(0)  # as many seeds as asked
def test_outputs_with_the_store_equal_a_cold_run_many_seeds(tiny, reference, tmp_path):
    """KVSTORE_DIFF_EXAMPLES seeds from KVSTORE_DIFF_SEED."""
    first = int(os.environ.get("KVSTORE_DIFF_SEED", "1000"))
    n = int(os.environ.get("KVSTORE_DIFF_EXAMPLES", "300"))
    print(run_seeds(range(first, first + n), tiny, reference, tmp_path))


@pytest.mark.long
@pytest.mark.timeout(0)  # as many seeds as asked
def test_outputs_through_a_daemon_equal_a_cold_run_many_seeds(tiny, reference, daemon, tmp_path):
    """KVSTORE_DIFF_EXAMPLES / 10 seeds from KVSTORE_DIFF_SEED through the daemon."""
    first = int(os.environ.get("KVSTORE_DIFF_SEED", "1000"))
    n = int(os.environ.get("KVSTORE_DIFF_EXAMPLES", "300")) // 10
    print(run_seeds(range(first, first + n), tiny, reference, tmp_path, daemon))


@pytest.mark.long
@pytest.mark.timeout(0)  # as many seeds as asked
def test_outputs_with_a_racing_deleter_equal_a_cold_run_many_seeds(tiny, reference, tmp_path):
    """KVSTORE_DIFF_EXAMPLES / 3 seeds from KVSTORE_DIFF_SEED with a thread dropping and
    deleting chunks all along (not reproducible run to run: a failure prints its log)."""
    first = int(os.environ.get("KVSTORE_DIFF_SEED", "1000"))
    n = int(os.environ.get("KVSTORE_DIFF_EXAMPLES", "300")) // 3
    print(run_seeds(range(first, first + n), tiny, reference, tmp_path, race=True))
