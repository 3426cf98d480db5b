"""``kvbench connector``: time to first token of the bundled engine when its KV comes from
the store instead of being recomputed, and a multi-turn conversation workload with and
without the store.

0. TTFT on real text (``bench/connector_text.py``): prose, documentation, code and chats of
   about ``--text-tokens`` tokens, lengths no multiple of the chunk: what a user will see.
1. TTFT on token ranges, the ideal case (exact chunk multiples, nothing left to compute but
   the last token), at each prompt length (default 512, 1k, 2k, 4k tokens of SmolLM2-135M, fp32 KV):
   cold (no store: the whole prefill recomputed) and a full-prefix hit loaded from
   (a) host RAM, in-process; (b) the local-disk tier, in a new engine process, with the
   chunk files' pages dropped from the page cache (fdatasync + POSIX_FADV_DONTNEED, checked
   with mincore) and the host copies dropped; (c) the daemon over shared memory; (d) the
   daemon over the remote path (bulk TCP). A hit computes only the last prompt token. Each
   hit reports the bytes loaded and the load's own time (the connector's: from its first
   read to the KV in the paged cache), and right after each load the machine's limit for the
   same bytes: memcpy (torch's threaded copy, best of 5 from distinct sources) beside host
   loads, a raw read of the same chunk files (the better of a buffered and an O_DIRECT read,
   cold; the files are read once before each load, so that a cache below the guest's page
   cache, as a virtual disk has, is in the same state for both) beside disk loads; cold runs
   alternate with host hits. Figures are medians of
   ``--repeats``, so a load and its limit see the same load on a shared machine. Engines are
   long-lived, as in serving: between runs the local prefix cache is reset, the KV cache and
   staging buffers are reused.
2. Multi-turn (``bench/connector_multi_turn.py``): conversations from the Mooncake conversation
   trace, each request through an engine without the store and one with it.

``--quick``: a tiny random checkpoint, short prompts and a few turns (a CI smoke test).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.connector_multi_turn import DEFAULT_TRACE, multi_turn

GB = 1e9
SOURCES = ("host", "disk", "shm", "remote")
# The whole trace where the checkout sits beside ../shared/traces, else the excerpt it ships.
PARTS = ("text", "ranges", "multi-turn")
TARGETS = {"real_text_hit_vs_cold": 0.1, "hit_vs_cold_at_2k": 0.25, "host_load_vs_memcpy": 0.5, "disk_load_vs_raw_read": 0.7,
           "multi_turn_mean_ttft_ratio": 0.5}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("connector", help="engine TTFT with KV loaded from the store vs recomputed; multi-turn")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M GGUF; tiny with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short prompts: a smoke test")
    p.add_argument("--parts", default="text,ranges,multi-turn",
                   help="which parts to run: text (real-text prompts), ranges (token ranges of exact chunk "
                        "multiples, the ideal case), multi-turn")
    p.add_argument("--text-tokens", type=int, default=2000, help="about this many tokens per real-text prompt")
    p.add_argument("--lengths", default="512,1024,2048,4096", help="token-range prompt lengths")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per store chunk")
    p.add_argument("--repeats", type=int, default=3, help="runs per TTFT figure (the median is kept)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (default: the engine's, one less than the cores it may use)")
    p.add_argument("--dir", default=None, help="directory for the disk tiers (default: a temporary one)")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake conversation trace (JSON lines, gzip)")
    p.add_argument("--conversations", type=int, default=6, help="conversations in the multi-turn run")
    p.add_argument("--turns", type=int, default=6, help="turns per conversation")
    p.add_argument("--block-tokens", type=int, default=64, help="tokens per 512-token trace block")
    p.add_argument("--max-prompt", type=int, default=2048, help="multi-turn prompts are cut to this many tokens")
    p.add_argument("--budget-prompts", type=float, default=1.0,
                   help="the multi-turn KV cache holds this many longest prompts")
    p.add_argument("--output-tokens", type=int, default=4, help="tokens generated per multi-turn request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def progress(message: str) -> None:
    print(f"kvbench connector: {message}", file=sys.stderr, flush=True)


# -- the machine's limits for the same bytes -------------------------------------------------

def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """The best memcpy of ``nbytes`` into a buffer already faulted in (bench/limits.py: one
    thread, threads over slices, torch's copy), each copy from its own source so that none
    reads what the cache still holds (a load reads bytes the store wrote long before)."""
    import numpy as np

    from bench.limits import memcpy_limit

    dst = np.zeros(nbytes, dtype=np.uint8)
    return memcpy_limit([(dst, np.ones(nbytes, dtype=np.uint8)) for _ in range(repeats)], repeat=1).gbps


def raw_read_gbps(paths: list[Path]) -> float:
    """The best cold read of the files: buffered or O_DIRECT, 1 to 8 in flight (bench/limits.py)."""
    from bench.limits import disk_read_limit

    return disk_read_limit([str(p) for p in paths]).gbps


# -- TTFT ------------------------------------------------------------------------------------

def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def first_token(llm, prompt: list[int]) -> dict:
    """One request for one token through a long-lived engine whose local prefix cache was reset:
    its TTFT, and what the connector loaded for it (bytes, the load's own seconds)."""
    from engine import SamplingParams

    llm.reset_prefix_cache()
    before = llm.connector.stats() if llm.connector else None
    (out,) = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0))
    result = {"ttft_s": out.metrics.ttft, "loaded_tokens": out.metrics.num_loaded_tokens,
              "computed_tokens": out.metrics.num_prefilled_tokens}
    if before is not None:
        after = llm.connector.stats()
        result["loaded_bytes"] = after.loaded_bytes - before.loaded_bytes
        result["load_s"] = after.load_s - before.load_s
    return result


def median_run(llm, prompt: list[int], repeats: int, before=None, limit=None) -> dict:
    """The median of ``repeats`` runs of ``first_token``; ``before()`` prepares each run, and
    ``limit(run)`` measures the machine's limit for the same bytes right after it (so a load
    and its limit see the same load on a shared machine)."""
    runs = []
    for _ in range(repeats):
        if before is not None:
            before()
        run = first_token(llm, prompt)
        if limit is not None:
            run.update(limit(run))
        runs.append(run)
    median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
    load = f", load {median['load_s']:.4f} s for {median['loaded_bytes'] / 1e6:.1f} MB" if "load_s" in median else ""
    progress(f"  {len(prompt)} tokens: TTFT {median['ttft_s']:.4f} s{load}")
    return median


def full_hit(run: dict, length: int) -> dict:
    """A full-prefix hit: everything loaded but the last token, which is computed."""
    if run["loaded_tokens"] != length or run["computed_tokens"] != 1:
        raise RuntimeError(f"expected a full-prefix hit of {length} tokens, got {run}")
    return run


@dataclass
class Setup:
    model: str
    lengths: list[int]
    chunk_tokens: int
    repeats: int
    threads: int
    root: Path
    block_size: int = 16

    def engine_config(self, **overrides):
        from engine import EngineConfig

        longest = max(self.lengths)
        kw = dict(num_blocks=longest // self.block_size + 16, block_size=self.block_size, dtype="float32",
                  max_num_batched_tokens=longest, max_num_seqs=4)
        return EngineConfig(**{**kw, **overrides})

    def connector_config(self, **overrides):
        from connector import ConnectorConfig

        return ConnectorConfig(chunk_tokens=self.chunk_tokens, **overrides)

    def store_config(self, host_bytes: int, disk_dir: Path):
        from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig, WriteBehindConfig

        return StoreConfig(host=HostTierConfig(capacity_bytes=host_bytes, page_bytes=1 << 20, fetch_workers=2),
                           disk=DiskTierConfig(path=str(disk_dir), capacity_bytes=4 * host_bytes),
                           write_behind=WriteBehindConfig(max_pending_bytes=host_bytes // 2))


def kv_bytes_per_token(llm) -> int:
    cfg = llm.model_config
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * llm.runner.kv_cache.element_size()


def memcpy(run: dict) -> dict:
    return {"memcpy_gbps": memcpy_gbps(run["loaded_bytes"])}


def host_bytes_for(base, prompts) -> int:
    """Host RAM for every prompt's chunks, twice over, plus room for the pool's pages."""
    return 2 * sum(prompts) * kv_bytes_per_token(base) + (256 << 20)


def ttft_in_process(base, setup: Setup, prompts: dict[int, list[int]], results: dict) -> dict[int, list[Path]]:
    """Cold (recompute) and (a) host-RAM hits, in turn, so both see the same load on a shared
    machine; leaves every chunk on the disk tier for (b). Returns each length's chunk files."""
    from kvstore.keys import chunk_keys
    from kvstore.store import Store

    files = {}
    with Store(setup.store_config(host_bytes_for(base, prompts), setup.root / "disk")) as store, \
            base.with_config() as plain, base.with_config(kv_store=store, connector=setup.connector_config()) as llm:
        for length, prompt in prompts.items():
            progress(f"{length} tokens: saving, then cold runs and hits from host RAM in turn")
            first_token(llm, prompt)
            llm.flush_saves()
            colds = []

            def cold() -> None:
                colds.append(first_token(plain, prompt)["ttft_s"])

            results[length]["runs"]["host"] = full_hit(median_run(llm, prompt, setup.repeats, before=cold,
                                                                  limit=memcpy), length)
            results[length]["cold_s"] = statistics.median(colds)
            progress(f"  {length} tokens: cold TTFT {results[length]['cold_s']:.4f} s")
            files[length] = [store.tiers[1].path_of(k.id) for k in chunk_keys(prompt, llm.connector.namespace)]
        store.flush()
    return files


def disk_hits_in_a_new_process(setup: Setup, prompts: dict[int, list[int]], files: dict[int, list[Path]],
                               host_bytes: int) -> dict:
    """(b): a new engine process, a new Store on the same disk directory (host RAM empty)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_disk_child, args=(setup, prompts, files, host_bytes, queue))
    child.start()
    try:
        result = queue.get(timeout=1800)
    finally:
        child.join(60)
    if isinstance(result, str):
        raise RuntimeError(f"the disk-tier engine process failed: {result}")
    return result


def _disk_child(setup: Setup, prompts: dict, files: dict, host_bytes: int, queue) -> None:
    """In the new process: before each run, drop the chunks' host copies (promoted by the
    previous read) and their files' cached pages, then time a full-prefix hit."""
    try:
        import torch

        from engine import LLM
        from kvstore.keys import chunk_keys
        from kvstore.store import Store

        torch.set_num_threads(setup.threads)
        out = {}
        with Store(setup.store_config(host_bytes, setup.root / "disk")) as store, \
                LLM(setup.model, setup.engine_config(connector=setup.connector_config()), kv_store=store) as llm:
            for length, prompt in prompts.items():
                keys = chunk_keys(prompt, llm.connector.namespace)

                from bench.limits import drop_cache

                def cold() -> None:
                    """The virtual disk may cache below the guest's page cache: read the files
                    once first, so the load and the raw read after it start alike."""
                    raw_read_gbps(files[length])
                    store.drop(keys, "host")
                    drop_cache([str(p) for p in files[length]])

                def raw_read(run) -> dict:
                    return {"raw_read_gbps": raw_read_gbps(files[length])}

                before = store.stats().tiers["disk"].hits
                run = full_hit(median_run(llm, prompt, setup.repeats, before=cold, limit=raw_read), length)
                run["disk_chunk_reads"] = store.stats().tiers["disk"].hits - before
                out[length] = run
        queue.put(out)
    except BaseException as exc:  # reported to the parent, which raises
        queue.put(f"{type(exc).__name__}: {exc}")


def daemon_hits(base, setup: Setup, prompts: dict[int, list[int]], results: dict) -> None:
    """(c) and (d): one daemon; the chunks are saved through it once, then loaded over each path."""
    from connector import DaemonBackendConfig
    from kvstore.daemon.spawn import DaemonProcess

    host_bytes = host_bytes_for(base, prompts)
    config = setup.root / "daemon.toml"  # the daemon's own shared-memory slots, as users run it
    config.write_text(f'[store.host]\ncapacity_bytes = {host_bytes}\npage_bytes = {1 << 20}\n'
                      f'[store.disk]\nenabled = false\n')
    with DaemonProcess(["--config", str(config), "--listen", "127.0.0.1:0"]) as daemon:
        for source, transport in (("shm", "shm"), ("remote", "remote")):
            backend = DaemonBackendConfig(addr=daemon.addr, transport=transport)
            connector = setup.connector_config(backend="daemon", daemon=backend)
            with base.with_config(connector=connector) as llm:
                for length, prompt in prompts.items():
                    if source == "shm":
                        progress(f"{length} tokens: saving through the daemon")
                        first_token(llm, prompt)
                        llm.flush_saves()
                    progress(f"{length} tokens: hits from the daemon over {transport} ({llm.kv_store.path})")
                    results[length]["runs"][source] = full_hit(median_run(llm, prompt, setup.repeats), length)


def ttft_figures(base, setup: Setup, seed: int) -> dict:
    vocab = base.model_config.vocab_size
    prompts = {n: random_prompt(n, vocab, seed + n) for n in setup.lengths}
    results = {n: {"runs": {}} for n in setup.lengths}
    files = ttft_in_process(base, setup, prompts, results)
    progress("hits from the disk tier in a new engine process (cold page cache)")
    for length, run in disk_hits_in_a_new_process(setup, prompts, files, host_bytes_for(base, prompts)).items():
        results[length]["runs"]["disk"] = run
    daemon_hits(base, setup, prompts, results)
    for r in results.values():
        r["bytes"] = r["runs"]["host"]["loaded_bytes"]
        r["memcpy_gbps"] = r["runs"]["host"]["memcpy_gbps"]  # measured beside each host load
        r["raw_read_gbps"] = r["runs"]["disk"]["raw_read_gbps"]  # beside each disk load
        r["hit_s"] = {s: r["runs"][s]["ttft_s"] for s in SOURCES}
        r["load_s"] = {s: r["runs"][s]["load_s"] for s in SOURCES}
        r["load_gbps"] = {s: r["runs"][s]["loaded_bytes"] / r["runs"][s]["load_s"] / GB for s in SOURCES}
    return {str(n): r for n, r in results.items()}


# -- the command ------------------------------------------------------------------------------

def run(args) -> int:
    import torch

    from bench import connector_text
    from bench.cli import UsageError
    from engine import LLM
    from engine.assets import smollm2_gguf_path
    from engine.testing import make_tiny_checkpoint

    parts = set(args.parts.split(","))
    if not parts or parts - set(PARTS):
        raise UsageError(f"--parts takes a comma-separated subset of {', '.join(PARTS)}, not {args.parts!r}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    args.threads = torch.get_num_threads()
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-connector-"))
    try:
        if args.quick:
            args.lengths, args.chunk_tokens, args.repeats, args.text_tokens = "64,128", 32, 1, 150
            args.conversations, args.turns, args.block_tokens, args.max_prompt, args.output_tokens = 3, 2, 8, 256, 2
            args.budget_prompts = 1.0
            model = args.model or make_tiny_checkpoint(root / "tiny", num_layers=2)
        else:
            model = args.model or smollm2_gguf_path()
        lengths = [int(x) for x in args.lengths.split(",")]
        if any(n <= 0 or n % args.chunk_tokens for n in lengths):
            raise UsageError(f"every length must be a positive multiple of --chunk-tokens {args.chunk_tokens}")
        setup = Setup(str(model), lengths, args.chunk_tokens, args.repeats, args.threads, root)
        progress(f"loading {model}")
        base = LLM(model, setup.engine_config())
        results = {"model": str(model), "quick": args.quick, "threads": args.threads,
                   "chunk_tokens": args.chunk_tokens, "kv_bytes_per_token": kv_bytes_per_token(base),
                   "repeats": args.repeats, "load_average": os.getloadavg()}
        if "text" in parts:
            results["real_text"] = connector_text.measure(base, setup, args.text_tokens)
        if "ranges" in parts:
            results["ttft"] = ttft_figures(base, setup, args.seed)
            at = str(2048 if 2048 in lengths else max(lengths))
            results["figures_at"] = int(at)
            results["memcpy_gbps"] = results["ttft"][at]["memcpy_gbps"]
            results["raw_read_gbps"] = results["ttft"][at]["raw_read_gbps"]
        if "multi-turn" in parts:
            results["multi_turn"] = multi_turn(base, setup, args)
        results["checks"] = checks(results)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def checks(r: dict) -> dict:
    """The targets against this run's figures (token ranges at 2k tokens, or the longest)."""
    out = {"targets": TARGETS}
    if "real_text" in r:
        out["real_text_hit_vs_cold"] = {s: v["median"] for s, v in r["real_text"]["summary"].items()}
    if "ttft" in r:
        at = r["ttft"][str(r["figures_at"])]
        out["hit_vs_cold_at_2k"] = {s: at["hit_s"][s] / at["cold_s"] for s in SOURCES}
        out["host_load_vs_memcpy"] = at["load_gbps"]["host"] / at["memcpy_gbps"]
        out["disk_load_vs_raw_read"] = at["load_gbps"]["disk"] / at["raw_read_gbps"]
    if "multi_turn" in r:
        mt = r["multi_turn"]
        out["multi_turn_mean_ttft_ratio"] = mt["with_store"]["ttft_mean_s"] / mt["without_store"]["ttft_mean_s"]
    return out


def format_table(r: dict) -> str:
    from bench import connector_text

    lines = [f"model {r['model']}  chunk {r['chunk_tokens']} tokens  threads {r['threads']}  "
             f"KV {r['kv_bytes_per_token']} B/token  {r['repeats']} rounds  "
             f"load average {' '.join(f'{x:.2f}' for x in r['load_average'])}"]
    c = r["checks"]
    if "real_text" in r:
        lines += connector_text.format_table(r["real_text"])
        lines.append(f"target: real-text hit/cold <= {TARGETS['real_text_hit_vs_cold']} (median over the prompts)")
    if "ttft" in r:
        lines += ["token ranges, the ideal case (exact chunk multiples): TTFT (s): cold = recompute; a full-prefix "
                  "hit from host RAM / disk (new process, cold page cache) / daemon shm / daemon remote",
                  f"{'tokens':>6} {'MB':>6} {'cold':>7} {'host':>7} {'disk':>7} {'shm':>7} {'remote':>7}   "
                  f"load GB/s {'host':>6} {'disk':>6} {'shm':>6} {'remote':>6}   {'memcpy':>6} {'raw rd':>6}"]
        for n, t in r["ttft"].items():
            hits = " ".join(f"{t['hit_s'][s]:7.3f}" for s in SOURCES)
            loads = " ".join(f"{t['load_gbps'][s]:6.2f}" for s in SOURCES)
            lines.append(f"{n:>6} {t['bytes'] / 1e6:6.1f} {t['cold_s']:7.3f} {hits}             {loads}   "
                         f"{t['memcpy_gbps']:6.2f} {t['raw_read_gbps']:6.2f}")
        ratios = ", ".join(f"{s} {v:.3f}" for s, v in c["hit_vs_cold_at_2k"].items())
        lines.append(f"at {r['figures_at']} tokens: hit/cold {ratios} (target <= {TARGETS['hit_vs_cold_at_2k']}); "
                     f"host load/memcpy {c['host_load_vs_memcpy']:.2f} (>= {TARGETS['host_load_vs_memcpy']}); "
                     f"disk load/raw read {c['disk_load_vs_raw_read']:.2f} (>= {TARGETS['disk_load_vs_raw_read']})")
    if "multi_turn" in r:
        mt = r["multi_turn"]
        lines.append(f"multi-turn: {mt['requests']} requests ({mt['conversations']} conversations x {mt['turns']} "
                     f"turns, mean prompt {mt['mean_prompt_tokens']:.0f} tokens), KV cache {mt['kv_cache_tokens']} "
                     f"tokens")
        lines.append(f"{'':14} {'TTFT mean':>9} {'p90':>7} {'recomputed':>10}   hit tokens by tier")
        for name in ("with_store", "without_store"):
            m = mt[name]
            tiers = "  ".join(f"{k} {v}" for k, v in m["hit_tokens"].items())
            lines.append(f"{name:14} {m['ttft_mean_s']:9.3f} {m['ttft_p90_s']:7.3f} {m['recomputed_tokens']:10}   "
                         f"{tiers}")
        lines.append(f"multi-turn mean TTFT with/without the store {c['multi_turn_mean_ttft_ratio']:.2f} "
                     f"(target <= {TARGETS['multi_turn_mean_ttft_ratio']})")
    return "\n".join(lines)
