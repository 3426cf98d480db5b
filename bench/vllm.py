"""``kvbench vllm``: time to first token in real vLLM (CPU, fp32, SmolLM2-135M) with a prompt's
KV recomputed (cold), loaded from our store through connector/vllm.py (host RAM, and the disk
tier after a daemon restart), and loaded by vLLM's own ``ExampleConnector`` (safetensors files);
then a multi-turn conversation workload (bench/multi_turn.py) with and without our connector.

vLLM runs in its own venv (``bash scripts/setup.sh vllm``), driven through
``connector.vllm_process``; each engine is started once and serves every request, and the
engine of our connector serves both parts. TTFT is the wall time of one ``generate`` of one
prompt with ``max_tokens=1`` (prefill plus the first token, through vLLM's front end).

TTFT part: ``--repeats`` prompts per length (each a fresh slice of text, so nothing hits across
repeats). Our engine and one without a connector have prefix caching on (the multi-turn part
needs it) and empty it before every timed send, so a repeated prompt reaches our connector, and
is prefilled in full without one; ExampleConnector's engine has it off. The first send of each
prompt to a connector's engine saves it (that send's TTFT is kept as ``cold_*_first_send_s``);
once every save has landed, ``--rounds`` rounds over every prompt time our hit, ExampleConnector's
hit and the cold prefill without a connector (``cold_s``), interleaved request by request, so a
change in the machine's load falls on all alike (medians). vLLM logs our connector's counters
("KV Transfer metrics"), from which the load throughput is summed.

Multi-turn part: every turn sent alone, in the trace's order, to our engine and to one
without a connector, interleaved turn by turn; both have prefix caching on and a KV cache of
``--kv-blocks`` blocks, too small to keep every conversation. Throughput is prompt tokens
over the time each engine spent serving the turns.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROSE = Path(__file__).parent / "data" / "probe_prose.txt"
WARMUP_TOKENS = 100  # less than a chunk: never stored
STATS_INTERVAL_S = 11.0  # a little over vLLM's interval between two "KV Transfer metrics" lines
# An engine's processes spin on their shared-memory queues for a second after their last
# message (vLLM's SpinCondition, busy_loop_s = 1) before they wait idle: timed beside another
# engine's send, they take its cores. So a send to one engine waits until the others went idle.
VLLM_SPIN_S = 1.2
# what LMCache 0.5.6's LMCacheConnectorV1 did on CPU vLLM 0.32 here (docs/vllm.md, "LMCache")
LMCACHE_REFUSAL = ("LMCacheConnectorV1 starts on CPU vLLM, but its worker half refuses the CPU platform: "
                   "'RuntimeError: No supported cpu connector found.' (lmcache.v1.gpu_connector.CreateGPUConnector "
                   "knows cuda, xpu, musa and hpu); it then runs degraded (recompute): no hit, and each request "
                   "waits out the scheduler's lookup RPC to the worker")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("vllm", help="real vLLM's TTFT: cold vs a hit from our store vs ExampleConnector")
    p.add_argument("--lengths", default="512,1024,2048", help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=3, help="prompts per length (the median is kept)")
    p.add_argument("--chunk-tokens", type=int, default=256, help="tokens per store chunk")
    p.add_argument("--load-mode", default="sync", choices=("sync", "layerwise"), help="our connector's load mode")
    p.add_argument("--load-workers", type=int, default=2, help="our connector's loader threads")
    p.add_argument("--chunks-per-read", type=int, default=2, help="our connector's chunks per daemon read")
    p.add_argument("--rounds", type=int, default=3, help="hit rounds over every prompt, engines interleaved")
    p.add_argument("--no-example", action="store_true", help="skip vLLM's ExampleConnector (one engine start less)")
    p.add_argument("--kv-blocks", type=int, default=32, help="vLLM's KV cache in blocks of 128 tokens (prefix caching on)")
    p.add_argument("--no-multi-turn", action="store_true", help="skip the multi-turn workload (one engine start less)")
    p.add_argument("--mt-conversations", type=int, default=10, help="multi-turn: conversations from the trace")
    p.add_argument("--mt-turns", type=int, default=5, help="multi-turn: turns kept per conversation, at most")
    p.add_argument("--mt-min-turns", type=int, default=3, help="multi-turn: only conversations with this many turns")
    p.add_argument("--mt-block-tokens", type=int, default=128, help="multi-turn: tokens per 512-token trace block")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def progress(message: str) -> None:
    print(f"kvbench vllm: {message}", file=sys.stderr, flush=True)


def make_prompts(model: Path, lengths: list[int], repeats: int) -> dict[int, list[list[int]]]:
    """``repeats`` distinct prompts per length, cut from the probe prose repeated."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(PROSE.read_text()).ids
    text = ids * (max(lengths) // len(ids) + 2)
    prompts, offset = {}, 0
    for n in lengths:
        prompts[n] = []
        for _ in range(repeats):
            offset = (offset + 97) % len(ids)  # a different start each time: no prompt shares a chunk
            prompts[n].append(text[offset:offset + n])
    return prompts


def ttft(engine, prompt: list[int], fresh: bool = False) -> tuple[float, int]:
    """TTFT of one send and the tokens it found cached; ``fresh``: vLLM's own prefix cache is
    emptied first, so what is not recomputed came from the connector."""
    if fresh:
        engine.reset_prefix_cache()
    answer = engine.generate([prompt], max_tokens=1)
    return answer["seconds"], answer["cached"][0]


def measure_cold(engine, prompts, fresh: bool, settle=None) -> dict[int, list[float]]:
    """Cold TTFT of every prompt (its first send). ``settle({n: [prompt]})`` waits until the
    store holds a prompt and has nothing left to do in the background (our saves go on after
    the first token; on a 2-core machine the daemon's copy to disk would otherwise slow the
    next prompt's prefill), so each run starts on a quiet daemon."""
    engine.generate([prompts[min(prompts)][0][:WARMUP_TOKENS]], max_tokens=1)
    cold: dict[int, list[float]] = {}
    for n, batch in prompts.items():
        for prompt in batch:
            cold.setdefault(n, []).append(ttft(engine, prompt, fresh)[0])
            if settle is not None:
                settle({n: [prompt]})
    return cold


def measure_hits(engines: dict, prompts, rounds: int) -> dict[str, dict[int, list[tuple[float, int]]]]:
    """Hit TTFTs, the engines interleaved request by request (``engines``: name -> (engine,
    fresh)), so a change in the machine's load falls on all of them alike; the order of the
    engines turns by one every send, so none always follows the same one (all vLLM Workers
    share one core, and one engine's long prefill may slow whichever comes next)."""
    hits: dict[str, dict[int, list[tuple[float, int]]]] = {name: {} for name in engines}
    names = list(engines)
    turn = 0
    for _ in range(rounds):
        for n, batch in prompts.items():
            for prompt in batch:
                for name in names[turn % len(names):] + names[:turn % len(names)]:
                    engine, fresh = engines[name]
                    time.sleep(VLLM_SPIN_S)  # the engine sent to last goes idle first
                    hits[name].setdefault(n, []).append(ttft(engine, prompt, fresh))
                turn += 1
    return hits


def summary(cold: dict[int, list[float]], hits: dict[int, list[tuple[float, int]]]) -> dict[int, dict]:
    return {n: {"cold_s": statistics.median(cold[n]), "hit_s": statistics.median(s for s, _ in hits[n]),
                "hit_tokens": min(t for _, t in hits[n])} for n in cold}


def run_turns(engines: dict, turns, quiet=None) -> dict[str, dict]:
    """The multi-turn workload (bench/multi_turn.py), every turn sent alone in arrival order,
    the engines interleaved turn by turn (a change in the machine's load falls on all alike);
    each engine's prefix cache is emptied first. ``quiet(prompt)`` runs after each send: our
    saves (and the daemon's copies to disk) go on after the first token, and would otherwise
    fall on the next engine's turn."""
    from bench.multi_turn import TurnResult, summarize

    results: dict[str, list] = {name: [] for name in engines}
    busy = dict.fromkeys(engines, 0.0)
    for engine in engines.values():
        engine.reset_prefix_cache()
    for turn in turns:
        for name, engine in engines.items():
            time.sleep(VLLM_SPIN_S)  # the engine sent to last goes idle first
            started = time.monotonic()
            answer = engine.generate([list(turn.prompt)], max_tokens=1)
            busy[name] += time.monotonic() - started
            results[name].append(TurnResult(answer["seconds"], len(turn.prompt), answer["cached"][0]))
            if quiet is not None:
                quiet(list(turn.prompt))
    return {name: summarize(results[name], busy[name]) for name in engines}


def transfer_totals(log: str) -> dict:
    """The connector's counters as vLLM logged them ("KV Transfer metrics: name=value, ...")."""
    totals: dict[str, float] = {}
    for line in log.splitlines():
        if "KV Transfer metrics:" in line:
            for item in line.split("KV Transfer metrics:", 1)[1].split(","):
                name, _, value = item.strip().partition("=")
                try:
                    totals[name] = totals.get(name, 0) + float(value)
                except ValueError:
                    continue
    return totals


def run(args) -> int:
    from bench.cli import UsageError
    from bench.multi_turn import TRACE, conversation_turns, read_trace
    from connector.vllm_process import SKIP_REASON, VLLM_PYTHON, VllmEngine, connector_kv_config
    from engine.hf_folder import smollm2_hf_path
    from kvstore.client import Client
    from kvstore.daemon.spawn import DaemonProcess
    from kvstore.keys import ROOT_HASH, ChunkKey, Namespace, prefix_hashes

    if not VLLM_PYTHON.exists():
        raise UsageError(SKIP_REASON)
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n <= 0 or n % args.chunk_tokens for n in lengths):
        raise UsageError(f"every length must be a positive multiple of --chunk-tokens {args.chunk_tokens}")
    model = smollm2_hf_path()
    prompts = make_prompts(model, lengths, args.repeats)
    max_len = max(lengths) + 256
    results = {"model": str(model), "lengths": lengths, "repeats": args.repeats, "chunk_tokens": args.chunk_tokens,
               "load_mode": args.load_mode, "load_workers": args.load_workers,
               "chunks_per_read": args.chunks_per_read,
               "load_average_before": os.getloadavg(), "engine_start_s": {}}
    root = Path(tempfile.mkdtemp(prefix="kvbench-vllm-"))
    # shared-memory slots of 32 MiB: one read call of two 11.8 MB chunks fits one slot
    (root / "daemon.toml").write_text('[shm]\nslots = 16\nslot_bytes = "32MiB"\n'
                                      '[store.host]\ncapacity_bytes = "2GiB"\npage_bytes = 1048576\n'
                                      '[store.disk]\ncapacity_bytes = "4GiB"\n')
    serve = ["--listen", "127.0.0.1:0", "--config", str(root / "daemon.toml"), "--data-dir", str(root / "data")]
    daemon = DaemonProcess(serve)
    addr = daemon.addr
    turns = None
    if not args.no_multi_turn:
        turns = conversation_turns(read_trace(), args.mt_conversations, args.mt_turns, args.mt_min_turns,
                                   block_tokens=args.mt_block_tokens, max_blocks=(max_len - 1) // args.mt_block_tokens)
    kv = {"max_model_len": max_len, "max_batched_tokens": max_len}
    small = {**kv, "prefix_caching": True, "num_blocks": args.kv_blocks}  # too small to keep every conversation
    multi_turn: dict[str, dict] = {}
    try:
        progress(f"our connector: starting vLLM (daemon {addr})")
        config = connector_kv_config(addr, None, chunk_tokens=args.chunk_tokens, load_mode=args.load_mode,
                                     load_workers=args.load_workers, chunks_per_read=args.chunks_per_read)
        with contextlib.ExitStack() as stack:
            engine = stack.enter_context(VllmEngine(model, config, **small))
            client = stack.enter_context(Client(addr))
            results["engine_start_s"]["ours"] = engine.start_s
            ns = Namespace(**engine.call(op="namespace"))

            def keys(prompt):
                full = len(prompt) // args.chunk_tokens * args.chunk_tokens
                return [ChunkKey(ns, h) for h in prefix_hashes(prompt[:full], args.chunk_tokens, ROOT_HASH)]

            def settle(prompts, timeout_s=300.0):
                """Every chunk in the daemon, and its write-behind to disk done: hits measured
                while the daemon copies 100 MB to disk on a 2-core machine measure the copy."""
                deadline = time.monotonic() + timeout_s
                for batch in prompts.values():
                    for prompt in batch:
                        while client.lookup(keys(prompt)) < len(keys(prompt)):
                            if time.monotonic() > deadline:
                                raise RuntimeError("the connector's saves did not reach the daemon")
                            time.sleep(0.05)
                while (st := client.stats()).write_behind_queue or st.write_behind_pending_bytes:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the daemon's write-behind did not finish")
                    time.sleep(0.05)

            progress("vLLM without a connector: starting vLLM")
            plain = stack.enter_context(VllmEngine(model, None, **small))
            results["engine_start_s"]["none"] = plain.start_s
            plain.generate([prompts[min(prompts)][0][:WARMUP_TOKENS]], max_tokens=1)
            engines = {"ours": (engine, True), "none": (plain, True)}  # none: a cold prefill, interleaved
            example_engine = None
            if not args.no_example:
                progress("vLLM's ExampleConnector: starting vLLM")
                example_config = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"shared_storage_path": str(root / "example")}}
                example_engine = VllmEngine(model, example_config, **kv)
                stack.callback(example_engine.close)
                results["engine_start_s"]["example"] = example_engine.start_s
                engines["example"] = (example_engine, False)
            cold = {"ours": measure_cold(engine, prompts, True, settle)}
            if example_engine is not None:
                cold["example"] = measure_cold(example_engine, prompts, False)
            hits = measure_hits(engines, prompts, args.rounds)
            ours = summary(cold["ours"], hits["ours"])
            cold_none = {n: statistics.median(s for s, _ in runs) for n, runs in hits["none"].items()}
            example = summary(cold["example"], hits["example"]) if example_engine is not None else {}
            if example_engine is not None:
                example_engine.close()  # its cores go back to the rest of the run
            progress("restarting the daemon: host RAM emptied, the disk tier kept")
            daemon.stop()
            daemon = DaemonProcess([*serve[:1], addr, *serve[2:]])
            settle(prompts)
            for n, batch in prompts.items():
                runs = [ttft(engine, prompt, True) for prompt in batch]
                ours[n]["after_restart_s"] = statistics.median(s for s, _ in runs)
                ours[n]["after_restart_tokens"] = min(t for _, t in runs)
            time.sleep(STATS_INTERVAL_S)  # vLLM logs the connector's counters at this interval
            engine.generate([prompts[min(prompts)][0][:WARMUP_TOKENS]], max_tokens=1)
            transfers = transfer_totals(engine.text)
            if turns is not None:
                progress(f"multi-turn workload: {len(turns)} requests, with and without our connector, interleaved")

                def quiet(prompt):
                    try:
                        settle({0: [prompt]}, timeout_s=10.0)
                    except RuntimeError:
                        pass  # a save dropped or still queued: go on, it is part of the workload

                multi_turn = run_turns({"ours": engine, "none": plain}, turns, quiet)
                time.sleep(STATS_INTERVAL_S)  # vLLM logs the connector's counters at this interval
                engine.generate([prompts[min(prompts)][0][:WARMUP_TOKENS]], max_tokens=1)
                loaded = transfer_totals(engine.text).get("loaded_tokens", 0) - transfers.get("loaded_tokens", 0)
                multi_turn["ours"]["loaded_tokens_logged"] = loaded
    finally:
        daemon.stop()
    results["load_average_after"] = os.getloadavg()
    results["ours_transfers"] = transfers  # summed over the TTFT runs: every load and save of our connector
    if transfers.get("load_s"):
        results["ours_load_gbps"] = transfers.get("loaded_bytes", 0) / transfers["load_s"] / 1e9
    results["ttft"] = {
        str(n): {"cold_s": cold_none[n], "cold_ours_first_send_s": ours[n]["cold_s"],
                 "cold_example_first_send_s": example.get(n, {}).get("cold_s"),
                 "hit_tokens": {"ours": ours[n]["hit_tokens"], "ours_after_restart": ours[n]["after_restart_tokens"],
                                "example": example.get(n, {}).get("hit_tokens")},
                 "hit_s": {"ours": ours[n]["hit_s"], "ours_after_restart": ours[n]["after_restart_s"],
                           "example": example.get(n, {}).get("hit_s"), "lmcache": None}}
        for n in lengths}
    results["lmcache"] = {"ran": False, "why": LMCACHE_REFUSAL}
    if turns is not None:
        results["multi_turn"] = {
            **multi_turn, "lmcache": None,
            "mean_ratio": multi_turn["ours"]["ttft_mean_s"] / multi_turn["none"]["ttft_mean_s"],
            "workload": {"trace": TRACE.name, "conversations": args.mt_conversations, "max_turns": args.mt_turns,
                         "min_turns": args.mt_min_turns, "block_tokens": args.mt_block_tokens,
                         "requests": len(turns), "prompt_tokens": sum(len(t.prompt) for t in turns),
                         "reusable_tokens": sum(t.reusable_tokens for t in turns), "kv_blocks": args.kv_blocks}}
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def format_table(r: dict) -> str:
    def cell(x):
        return "-" if x is None else f"{x:.3f}"

    lines = ["| tokens | cold s (no connector) | ours (host RAM) s | ours after restart (disk) s | ExampleConnector s | "
             "hit/cold ours | loaded tokens ours / example |", "|---:|---:|---:|---:|---:|---:|---|"]
    for n, f in r["ttft"].items():
        h = f["hit_s"]
        lines.append(f"| {n} | {cell(f['cold_s'])} | {cell(h['ours'])} | {cell(h['ours_after_restart'])} | "
                     f"{cell(h['example'])} | {h['ours'] / f['cold_s']:.2f} | "
                     f"{f['hit_tokens']['ours']} / {f['hit_tokens']['example']} |")
    starts = ", ".join(f"{k} {v:.0f} s" for k, v in r["engine_start_s"].items())
    lines.append(f"engine starts: {starts}; load average before {r['load_average_before'][0]:.1f}, "
                 f"after {r['load_average_after'][0]:.1f}")
    m = r.get("multi_turn")
    if m:
        w = m["workload"]
        lines.append(f"\nmulti-turn: {w['requests']} requests of {w['conversations']} conversations, "
                     f"{w['prompt_tokens']} prompt tokens ({w['reusable_tokens']} reusable), KV cache {w['kv_blocks']} blocks")
        lines += ["| connector | TTFT mean s | TTFT P90 s | prompt tokens/s | tokens recomputed |",
                  "|---|---:|---:|---:|---:|"]
        for name in ("ours", "none"):
            f = m[name]
            lines.append(f"| {name} | {f['ttft_mean_s']:.3f} | {f['ttft_p90_s']:.3f} | "
                         f"{f['throughput_tokens_per_s']:.0f} | {f['tokens_recomputed']} |")
        lines.append(f"mean TTFT ours / none: {m['mean_ratio']:.2f}")
    t = r["ours_transfers"]
    if t.get("load_s"):
        lines.append(f"our loads: {t.get('loaded_bytes', 0) / 1e6:.0f} MB in {t['load_s']:.3f} s "
                     f"({r['ours_load_gbps']:.2f} GB/s, first read to KV in vLLM's blocks), {t.get('loads', 0):.0f} loads")
    return "\n".join(lines)
