"""``kvbench agents``: agent sessions that stall on tool calls, through the real engine, four ways.

Every mode runs the same sessions (bench/agent_trace.py: synthetic or a JSONL trace) on the
same device KV budget, too small for every session's history at once:

- ``recompute``: no store; a paused session's blocks are freed (the local prefix cache
  keeps them until they are reused), and a resume recomputes what was lost;
- ``keep``: no store; a paused session's blocks stay held on the device through the stall
  (released only when nothing else could run);
- ``events``: the store behind the connector; ``pause(session, expected_s)`` after each turn
  and ``resume_soon(session, eta)`` shortly before the next (engine/sessions.py);
- ``predict``: the store, no events: the engine predicts each stall from past ones.

Per session, end-to-end latency (first arrival to last token, stalls included); per resumed
turn, TTFT and the tokens recomputed (prefilled again though they had KV before the stall);
device-memory occupancy over time; sessions in flight (admitted, not done) and, of those,
retained ones (a turn in the engine, or paused with the KV held on the device or every full
chunk of it in the store); warm resumes (resumed turns that recomputed less than a chunk). Outputs are compared
token for token with the recompute mode's.
"""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.agent_trace import AgentSession, dump_jsonl, load_jsonl, synthetic

MODES = ("recompute", "keep", "events", "predict")
PROSE = Path(__file__).parent / "data" / "probe_prose.txt"


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("agents", help="agent sessions across tool stalls: recompute, keep, events, predict")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M GGUF)")
    p.add_argument("--trace", default=None, help="replay sessions from this JSONL file (format: bench/agent_trace.py)")
    p.add_argument("--save-trace", default=None, help="write the sessions run to this JSONL file")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    p.add_argument("--sessions", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=128, help="shared system prompt before every task")
    p.add_argument("--task-tokens", type=int, default=256)
    p.add_argument("--tool-tokens", type=int, default=192, help="tool output appended before each later turn")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--stall-median-s", type=float, default=1.0)
    p.add_argument("--stall-sigma", type=float, default=1.0, help="log-normal sigma of the stalls")
    p.add_argument("--stall-max-s", type=float, default=12.0)
    p.add_argument("--arrival-gap-s", type=float, default=0.5, help="mean gap between session arrivals (Poisson)")
    p.add_argument("--kv-tokens", type=int, default=2048, help="device KV budget in tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, default=128)
    p.add_argument("--host-mb", type=int, default=192, help="the store's host RAM in MB (a disk tier below it)")
    p.add_argument("--max-batched-tokens", type=int, default=256)
    p.add_argument("--resume-priority-bound", type=int, default=4,
                   help="times a cold request may be bypassed by staged resumers (0: no priority)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 avoids OpenMP spin contention on shared cores)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write latency CDFs to this PNG")
    p.set_defaults(func=run)


@dataclass
class SessionRun:
    spec: AgentSession
    history: list[int] = field(default_factory=list)  # prompt + output so far
    turn: int = 0
    next_arrival: float = 0.0
    resume_sent: bool = False
    seq: object = None
    first_arrival: float | None = None
    admitted: bool = False
    done_at: float | None = None
    prev_kv: int = 0  # tokens with KV when the last turn finished
    inputs: list[list[int]] = field(default_factory=list)  # per turn, drawn up front
    outputs: list[list[int]] = field(default_factory=list)
    ttft_resumed: list[float] = field(default_factory=list)
    recomputed: int = 0
    resume_recomputed: list[int] = field(default_factory=list)  # per resumed turn


class Inputs:
    """Token ids for the sessions' inputs: the system prompt is real prose; each session's task
    and tool outputs are token ids drawn from a generator seeded by session and turn, so every
    session's history is its own and every mode sees the same tokens."""

    def __init__(self, tokenizer, vocab_size: int, system_tokens: int, seed: int) -> None:
        self.tokenizer, self.vocab_size, self.seed = tokenizer, vocab_size, seed
        prose = tokenizer.encode(PROSE.read_text())
        self.system = (prose * (1 + system_tokens // max(1, len(prose))))[:system_tokens]

    def take(self, session: int, turn: int, n: int, text: str | None) -> list[int]:
        if text is not None:
            return self.tokenizer.encode(text)
        rng = random.Random(f"{self.seed}/{session}/{turn}")
        return [rng.randrange(3, self.vocab_size - 8) for _ in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q * (len(v) - 1))))]


def run_mode(base, mode: str, sessions: list[AgentSession], args, store_dir: Path) -> dict:
    from connector import ConnectorConfig
    from engine import SamplingParams
    from engine.agent_config import AgentConfig
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig

    connector = None
    if mode in ("events", "predict"):
        shutil.rmtree(store_dir, ignore_errors=True)
        store = StoreConfig(host=HostTierConfig(capacity_bytes=args.host_mb << 20, page_bytes=1 << 20),
                            disk=DiskTierConfig(path=str(store_dir), capacity_bytes=4 << 30))
        connector = ConnectorConfig(chunk_tokens=args.chunk_tokens, store=store)
    policy = {"recompute": "drop", "keep": "keep"}.get(mode, "auto")
    llm = base.with_config(num_blocks=args.kv_tokens // args.block_size, block_size=args.block_size,
                           max_num_batched_tokens=args.max_batched_tokens, connector=connector,
                           agents=AgentConfig(policy=policy, resume_priority_bound=args.resume_priority_bound))
    inputs = Inputs(llm.tokenizer, llm.model_config.vocab_size, args.system_tokens, args.seed)
    runs = [SessionRun(s, next_arrival=s.arrival_s) for s in sessions]
    for i, r in enumerate(runs):
        r.inputs = [inputs.take(i, j, t.input_tokens, t.input) for j, t in enumerate(r.spec.turns)]
    occupancy, concurrency = [], []
    t0 = time.perf_counter()
    events = mode == "events"
    try:
        while any(r.done_at is None for r in runs):
            now = time.perf_counter() - t0
            for r in runs:
                if r.done_at is not None or r.seq is not None:
                    continue
                if events and r.turn and not r.resume_sent and now >= r.next_arrival - lead_s(llm, r):
                    llm.resume_soon(r.spec.session, max(0.0, r.next_arrival - now))
                    r.resume_sent = True
                if now >= r.next_arrival:
                    turn = r.spec.turns[r.turn]
                    prompt = (inputs.system if r.turn == 0 else r.history) + r.inputs[r.turn]
                    params = SamplingParams(max_tokens=turn.output_tokens, temperature=0, ignore_eos=True)
                    r.seq = llm.add_request(prompt, params, session=r.spec.session, critical=r.spec.critical)
                    r.first_arrival = now if r.first_arrival is None else r.first_arrival
            if not llm.has_unfinished():
                pending = [r.next_arrival for r in runs if r.done_at is None and r.seq is None]
                time.sleep(max(0.0, min(0.05, min(pending) - now)) if pending else 0.01)
                continue
            outs = llm.step()
            now = time.perf_counter() - t0
            bm = llm.block_manager
            occupancy.append((round(now, 3), 1 - bm.num_free / len(bm.blocks)))
            for r in runs:
                if r.seq is not None and r.seq.metrics.first_scheduled_time is not None:
                    r.admitted = True
            concurrency.append((sum(1 for r in runs if r.admitted and r.done_at is None), retained(llm, runs)))
            for out in outs:
                if out.finished:
                    finish_turn(llm, runs, out, now, events)
    finally:
        llm.close()
    return summarise(mode, runs, occupancy, concurrency, llm, args.chunk_tokens)


def retained(llm, runs: list[SessionRun]) -> int:
    """Sessions in flight whose context survives: a turn in the engine, or paused with its KV
    held on the device or every full chunk of it still in the store."""
    from kvstore.keys import chunk_keys

    n = 0
    for r in runs:
        if not r.admitted or r.done_at is not None:
            continue
        s = llm.sessions.sessions.get(r.spec.session)
        if r.seq is not None and r.seq.metrics.first_scheduled_time is not None:
            n += 1
        elif s is not None and s.hold is not None:
            n += 1
        elif s is not None and llm.connector is not None and s.token_ids:
            keys = chunk_keys(s.token_ids, llm.connector.namespace)
            n += llm.kv_store.lookup(keys) == len(keys)
    return n


def lead_s(llm, r: SessionRun) -> float:
    """How long before the return resume_soon goes out: TokenCake's max(0.1 s, 1.25 x load time)."""
    nbytes = len(r.history) * llm.sessions.kv_bytes_per_token
    return max(0.1, 1.25 * nbytes / llm.sessions.load_bytes_per_s())


def finish_turn(llm, runs: list[SessionRun], out, now: float, events: bool) -> None:
    r = next(r for r in runs if r.seq is not None and r.seq.request_id == out.request_id)
    seq, r.seq = r.seq, None
    m = seq.metrics
    if r.turn:
        r.ttft_resumed.append(m.first_token_time - m.arrival_time)
        again = max(0, m.num_prefilled_tokens - (len(seq.prompt_token_ids) - r.prev_kv))
        r.recomputed += again
        r.resume_recomputed.append(again)
    r.outputs.append(list(seq.output_token_ids))
    r.history = list(seq.token_ids)
    r.prev_kv = len(seq.token_ids) - 1
    turn = r.spec.turns[r.turn]
    r.turn += 1
    if r.turn == len(r.spec.turns):
        r.done_at = now
        llm.end_session(r.spec.session)
        return
    r.next_arrival, r.resume_sent = now + turn.stall_s, False
    if events:
        llm.pause(r.spec.session, turn.announced_s, turn.tool)


def summarise(mode: str, runs: list[SessionRun], occupancy, concurrency, llm, chunk_tokens: int) -> dict:
    e2e = [r.done_at - r.first_arrival for r in runs]
    in_flight, kept = [c for c, _ in concurrency], [k for _, k in concurrency]
    resumes = [t for r in runs for t in r.resume_recomputed]
    ttft = [t for r in runs for t in r.ttft_resumed]
    stats = llm.stats()
    return {
        "e2e_mean_s": round(sum(e2e) / len(e2e), 3),
        "e2e_p50_s": round(percentile(e2e, 0.5), 3),
        "e2e_p90_s": round(percentile(e2e, 0.9), 3),
        "e2e_p99_s": round(percentile(e2e, 0.99), 3),
        "resumed_ttft_mean_s": round(sum(ttft) / len(ttft), 3) if ttft else 0.0,
        "resumed_ttft_p90_s": round(percentile(ttft, 0.9), 3),
        "tokens_recomputed": sum(r.recomputed for r in runs),
        "prefilled_tokens": stats.prefilled_tokens,
        "loaded_tokens": stats.loaded_tokens,
        "sessions_served": sum(1 for r in runs if r.done_at is not None),
        "warm_resumes": round(sum(1 for t in resumes if t < chunk_tokens) / max(1, len(resumes)), 3),
        "sessions_in_flight_mean": round(sum(in_flight) / max(1, len(in_flight)), 2),
        "sessions_in_flight_max": max(in_flight, default=0),
        "sessions_retained_mean": round(sum(kept) / max(1, len(kept)), 2),
        "sessions_retained_max": max(kept, default=0),
        "occupancy_mean": round(sum(o for _, o in occupancy) / max(1, len(occupancy)), 3),
        "occupancy": occupancy[::max(1, len(occupancy) // 200)],
        "connector": dataclasses.asdict(stats.connector) if stats.connector else None,
        "decisions": {str(getattr(k, "value", k)): v for k, v in llm.sessions.counts.items()},
        "e2e_s": [round(x, 3) for x in e2e],
        "resumed_ttft_s": [round(x, 3) for x in ttft],
        "outputs": [r.outputs for r in runs],
    }


def run(args) -> int:
    import torch

    from engine import LLM, EngineConfig
    from engine.assets import smollm2_gguf_path

    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - set(MODES)
    if unknown:
        raise ValueError(f"unknown modes {sorted(unknown)}; known: {', '.join(MODES)}")
    if args.trace:
        sessions = load_jsonl(args.trace)
    else:
        sessions = synthetic(args.sessions, args.turns, args.task_tokens, args.tool_tokens, args.output_tokens,
                             args.stall_median_s, args.stall_sigma, args.stall_max_s, args.arrival_gap_s, args.seed)
    if args.save_trace:
        dump_jsonl(sessions, args.save_trace)
    base = LLM(args.model or smollm2_gguf_path(), EngineConfig(dtype="float32"))
    results = {"config": {k: v for k, v in vars(args).items() if k != "func"}, "modes": {}}
    store_dir = Path(tempfile.mkdtemp(prefix="kvbench-agents-"))
    try:
        for mode in modes:
            print(f"kvbench agents: {mode} ...", file=sys.stderr, flush=True)
            results["modes"][mode] = run_mode(base, mode, sessions, args, store_dir)
    finally:
        shutil.rmtree(store_dir, ignore_errors=True)
    reference = results["modes"].get("recompute", next(iter(results["modes"].values())))["outputs"]
    for r in results["modes"].values():
        r["outputs_match"] = r.pop("outputs") == reference
    results["gains"] = gains(results["modes"])
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    return 0


def gains(modes: dict) -> dict:
    """Mean end-to-end latency cut against recompute, and against keep, per mode."""
    out = {}
    for name, r in modes.items():
        g = {}
        for base in ("recompute", "keep"):
            if base in modes and base != name:
                g[f"vs_{base}"] = round(1 - r["e2e_mean_s"] / modes[base]["e2e_mean_s"], 3)
        out[name] = g
    return out


def format_table(results: dict) -> str:
    head = ("mode", "e2e mean", "p50", "p90", "p99", "resumed TTFT", "recomputed", "loaded", "warm resumes",
            "retained mean/max", "in flight", "occupancy", "outputs =")
    rows = [head]
    for name, r in results["modes"].items():
        rows.append((name, f"{r['e2e_mean_s']:.2f}", f"{r['e2e_p50_s']:.2f}", f"{r['e2e_p90_s']:.2f}",
                     f"{r['e2e_p99_s']:.2f}", f"{r['resumed_ttft_mean_s']:.3f}", str(r["tokens_recomputed"]),
                     str(r["loaded_tokens"]), f"{r['warm_resumes']:.0%}",
                     f"{r['sessions_retained_mean']:.2f}/{r['sessions_retained_max']}",
                     f"{r['sessions_in_flight_mean']:.2f}", f"{r['occupancy_mean']:.2f}",
                     "yes" if r["outputs_match"] else "NO"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    for name, g in results["gains"].items():
        if g:
            lines.append(f"{name}: mean e2e cut " + ", ".join(f"{v:.1%} {k.replace('_', ' ')}" for k, v in g.items()))
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    """Latency CDFs (sessions end to end, resumed turns' TTFT) and device occupancy over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in results["modes"].items():
        for ax, key in zip(axes, ("e2e_s", "resumed_ttft_s")):
            xs = sorted(r[key])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
        axes[2].plot([t for t, _ in r["occupancy"]], [o for _, o in r["occupancy"]], label=name, linewidth=0.8)
    axes[0].set(title="session end-to-end latency", xlabel="seconds", ylabel="CDF")
    axes[1].set(title="TTFT of resumed turns", xlabel="seconds", xscale="log")
    axes[2].set(title="device KV blocks in use", xlabel="seconds into the run", ylabel="fraction", ylim=(0, 1.05))
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
