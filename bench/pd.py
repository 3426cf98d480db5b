"""``kvbench pd``: prefill-decode disaggregation through the store, against colocated serving.

1. Timing, with real processes: two daemons (a "prefill node" and a "decode node"), each
   with host RAM and a PFS tier on one shared directory whose bandwidth, reads and writes,
   is capped at ``--link-gbps`` (``tiers/throttle.py``): the link between the nodes. The
   prefill engine's durable puts cross it once, the decode engine's reads once more.
   Requests with the Mooncake trace's prompt and output lengths scaled down run one at a
   time (two CPU cores: concurrent engines would time each other) through the router for
   each configuration: colocated (one engine, no store), disaggregated raw, and
   disaggregated with each ``--codecs`` budget (fresh engines and a namespace of their own
   per configuration, so nothing is shared between them). TTFT (arrival to the first token
   at the router; disaggregated: once the prefill's puts returned), time per output token,
   bytes over the link (the PFS tier's bytes written by the prefill node) and seconds per
   request (the producer's puts, the consumer's loads).
2. Quality, in-process on one Store: the codecs' perplexity change on the probe text
   (``bench/probe_model.py``: the KV of 512 tokens, its full chunks through the transfer
   codec with its ranking, 512 continuation tokens scored), greedy exact-match against raw
   on held prompts, and needle-in-a-haystack retrieval at ``--needle-lengths``. The prefill
   runs once per prompt (raw); each codec's chunks are its raw chunks re-encoded exactly as
   its producer would put them, under a namespace of its own, and a consumer decodes.

``--quick``: a tiny random checkpoint and a few short requests (a CI smoke test).
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import replace
from pathlib import Path

from bench.progress import Progress

GB = 1e9
_FULL_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl.gz"
DEFAULT_TRACE = _FULL_TRACE if _FULL_TRACE.exists() else Path(__file__).parent / "data" / "mooncake_conversation_head2000.jsonl.gz"
PROBE_TEXT = Path(__file__).parent / "data" / "probe_prose.txt"
DOCS = Path(__file__).resolve().parents[1] / "docs"
NEEDLE = "The special magic number is 73914. "
NEEDLE_ANSWER = "73914"
QUESTION = "\n\nWhat is the special magic number mentioned in the text above?"
TARGETS = {"raw_ttft_vs_colocated": 1.3, "max_ppl_change_pct": 2.0, "min_bytes_cut": 2.0}


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("pd", help="prefill-decode disaggregation through the store vs colocated serving")
    p.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M GGUF; tiny with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny random model, a few short requests: a smoke test")
    p.add_argument("--codecs", default="mixed75,mixed50,mixed25", help="transfer codecs to compare with raw")
    p.add_argument("--importance", choices=("keynorm", "recency", "attention"), default="keynorm",
                   help="how mixed codecs rank a chunk's tokens (the first 4 of a prompt always on top)")
    p.add_argument("--link-gbps", type=float, default=1.0, help="link between the nodes, GB/s (the PFS tier's cap)")
    p.add_argument("--requests", type=int, default=4, help="timed requests per configuration")
    p.add_argument("--trace", default=str(DEFAULT_TRACE), help="Mooncake trace (JSON lines): prompt/output lengths")
    p.add_argument("--prompt-scale", type=float, default=0.125, help="trace prompt lengths are scaled by this")
    p.add_argument("--output-scale", type=float, default=0.0625, help="trace output lengths are scaled by this")
    p.add_argument("--max-prompt", type=int, default=1024)
    p.add_argument("--max-output", type=int, default=16)
    p.add_argument("--held-prompts", type=int, default=4, help="prompts for greedy exact-match")
    p.add_argument("--held-tokens", type=int, default=600, help="tokens per held prompt")
    p.add_argument("--needle-lengths", default="512,1024", help="haystack lengths in tokens")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per engine")
    p.add_argument("--dir", default=None, help="working directory (default: a temporary one)")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


# -- inputs -----------------------------------------------------------------------------------


def trace_lengths(path: str, n: int, prompt_scale: float, output_scale: float, max_prompt: int,
                  max_output: int, min_prompt: int) -> list[tuple[int, int]]:
    """The first ``n`` requests' (prompt, output) lengths of a Mooncake trace, scaled down."""
    out = []
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        for line in f:
            if len(out) == n:
                break
            r = json.loads(line)
            out.append((min(max_prompt, max(min_prompt, int(r["input_length"] * prompt_scale))),
                        min(max_output, max(2, int(r["output_length"] * output_scale)))))
    if len(out) < n:
        raise ValueError(f"{path} has {len(out)} requests, {n} wanted")
    return out


def corpus_tokens(tokenizer) -> list[int]:
    """Tokens of the repository's prose (docs/*.md, then the probe text), for prompts."""
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    return tokenizer.encode(text + "\n\n" + PROBE_TEXT.read_text(encoding="utf-8"))


def needle_prompt(tokenizer, corpus: list[int], length: int) -> list[int]:
    """``length`` tokens of prose with the needle at half depth, then the question, as a chat turn."""
    text = tokenizer.decode(corpus[:length])
    cut = text.rfind(". ", 0, len(text) // 2) + 2
    doc = text[:cut] + NEEDLE + text[cut:]
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": doc + QUESTION}]))


# -- timing with processes ----------------------------------------------------------------------


def daemon_toml(root: Path, name: str, pfs: Path, link_bytes_per_s: int) -> Path:
    path = root / f"{name}.toml"
    path.write_text(f"""listen = "127.0.0.1:0"
[shm]
slots = 8
slot_bytes = "16MiB"
[store.host]
capacity_bytes = "512MiB"
[store.disk]
enabled = false
[store.pfs]
enabled = true
path = "{pfs}"
capacity_bytes = "8GiB"
read_bytes_per_s = {link_bytes_per_s}
""")
    return path


def timing(model: str, args, root: Path, requests) -> dict:
    from connector import ConnectorConfig, DaemonBackendConfig
    from connector.config import TransferConfig
    from engine.config import EngineConfig
    from engine.pd import EngineSpec
    from engine.router import EngineProcess, Router
    from kvstore.client import Client
    from kvstore.daemon.spawn import DaemonProcess

    pfs = root / "pfs"
    pfs.mkdir()
    link = int(args.link_gbps * GB)
    # Every process spends seconds importing before it serves: start (and stop) them side by side.
    pool = ThreadPoolExecutor(8)
    daemons = {n: pool.submit(DaemonProcess, ["--config", str(daemon_toml(root, n, pfs, link)),
                                              "--data-dir", str(root / n)])
               for n in ("prefill-node", "decode-node")}
    daemons = {n: f.result() for n, f in daemons.items()}
    longest = max(len(r.prompt) + r.params.max_tokens for r in requests)
    blocks = -(-longest // 16) * 2 + 16
    names = ["colocated", "raw"] + args.codecs

    def engine(name, role, node):
        conn = None
        if role != "colocated":
            d = daemons[node]
            conn = ConnectorConfig(
                backend="daemon", daemon=DaemonBackendConfig(addr=d.addr, timeout_s=30.0),
                chunk_tokens=args.chunk_tokens, role={"prefill": "producer", "decode": "consumer"}[role],
                tenant=f"pd-{name}", max_pending_saves=64,
                transfer=TransferConfig(codec=name, importance=args.importance,
                                        wait_s=30.0))
        cfg = EngineConfig(num_blocks=blocks, block_size=16, max_num_batched_tokens=512, dtype="float32",
                           connector=conn)
        return EngineProcess(EngineSpec(model, cfg, role, args.threads))

    engines: dict[str, list] = {}
    try:
        progress(f"starting engines: {', '.join(names)}")
        starting = {name: [pool.submit(engine, name, "colocated", None)] if name == "colocated" else
                    [pool.submit(engine, name, "prefill", "prefill-node"),
                     pool.submit(engine, name, "decode", "decode-node")] for name in names}
        # each engine process loads the model on two shared cores: a minute or more for all of them
        every = [f for futures in starting.values() for f in futures]
        started = Progress(len(every), "engines started", every_s=10.0)
        for _ in as_completed(every):
            started.step()
        for name, futures in starting.items():
            engines[name] = [f.result() for f in futures if f.exception() is None]  # closed below if others failed
        for futures in starting.values():
            for f in futures:
                f.result()
        routers = {n: Router(e[0]) if n == "colocated" else Router(e[1], e[0]) for n, e in engines.items()}
        warm = requests[0]
        for router in routers.values():
            # reversed: no prefix in common with a timed request (it would hit the local prefix cache)
            router.run([replace(warm, request_id="warm", prompt=warm.prompt[::-1][: args.chunk_tokens + 8])])
        served = {n: [] for n in names}
        links = {n: [] for n in names}
        for i, r in enumerate(requests):
            # each request in every configuration back to back (they see the same machine), in an
            # order rotated per request (so no configuration always runs first)
            for name in names[i % len(names):] + names[:i % len(names)]:
                before = {n: _pfs(Client, d) for n, d in daemons.items()}
                served[name] += routers[name].run([r])
                links[name].append((before, {n: _pfs(Client, d) for n, d in daemons.items()}))
                progress(f"{name}: {r.request_id} ({len(r.prompt)} prompt tokens) ttft {served[name][-1].ttft_s:.3f}s")
        return {n: summarize(served[n], links[n], [e.ask("stats")["stats"] for e in engines[n]], n) for n in names}
    finally:
        list(pool.map(lambda e: e.close(), [e for es in engines.values() for e in es]))
        list(pool.map(lambda d: d.stop(), daemons.values()))
        pool.shutdown()


def _pfs(client_cls, daemon) -> dict:
    with client_cls(daemon.addr) as c:
        t = c.stats().tiers["pfs"]
        return {"written": t.bytes_written, "read": t.bytes_read}


def summarize(served, links, stats, name) -> dict:
    n = len(served)

    def link(node, field):
        return sum(after[node][field] - before[node][field] for before, after in links) // n

    out = {
        "ttft_mean_s": statistics.fmean(s.ttft_s for s in served),
        "ttft_s": [s.ttft_s for s in served],
        "tpot_mean_s": statistics.fmean(s.tpot_s for s in served),
        "second_token_mean_s": statistics.fmean(s.token_times[1] - s.token_times[0] for s in served),
        # steady decoding: from the second token on (the second includes a decode's load)
        "tpot_decode_mean_s": statistics.fmean((s.token_times[-1] - s.token_times[1]) / (len(s.token_times) - 2)
                                               for s in served if len(s.token_times) > 2),
        "transfer_bytes": 0, "link_read_bytes": 0, "put_s": 0.0, "load_s": 0.0, "transfer_s": 0.0,
        "loaded_tokens": 0, "wait_timeouts": 0, "rerouted": 0,
        "outputs": [s.token_ids for s in served],
    }
    if name != "colocated":
        producer = stats[0].connector
        out.update(
            transfer_bytes=link("prefill-node", "written"), link_read_bytes=link("decode-node", "read"),
            put_s=producer.put_s / n, load_s=statistics.fmean(s.decode.kv_load_s for s in served),
            loaded_tokens=sum(s.decode.loaded_tokens for s in served) // n,
            wait_timeouts=sum(s.decode.wait_timed_out for s in served), rerouted=sum(s.rerouted for s in served))
        out["transfer_s"] = out["put_s"] + out["load_s"]
        out["promised_tokens"] = sum(s.prefill.transfer.num_tokens for s in served) // n
    return out


# -- quality in-process ---------------------------------------------------------------------------


def quality(base, model_path, args, corpus: list[int]) -> dict:
    """Per codec: perplexity change on the probe text, greedy exact-match vs raw on held
    prompts, needle retrieval, through a producer's encoding and a consumer's decode."""
    from connector import ConnectorConfig
    from connector.config import TransferConfig
    from connector.roles import TransferCodecs
    from engine.sampling import SamplingParams
    from kvstore.keys import Namespace, chunk_keys
    from kvstore.store import Store

    store = Store(_store_config())
    step = args.held_tokens + 97
    held = [corpus[i * step:i * step + args.held_tokens] for i in range(args.held_prompts)]
    needles = {n: needle_prompt(base.tokenizer, corpus[len(corpus) // 3:], n) for n in args.needle_lengths}
    prompts = held + list(needles.values())
    greedy = SamplingParams(max_tokens=args.max_output, temperature=0, ignore_eos=True)
    answer = SamplingParams(max_tokens=24, temperature=0)
    mc = base.model_config

    def connector(role, tenant):
        return ConnectorConfig(chunk_tokens=args.chunk_tokens, role=role, tenant=tenant, max_pending_saves=64,
                               transfer=TransferConfig(importance=args.importance))

    progress("quality: prefill of the held and needle prompts and the probe text (raw)")
    ppl = Perplexity(model_path, base, args.chunk_tokens)
    producer = base.with_config(kv_store=store, connector=connector("producer", ""))
    masses = {}  # with --importance attention: the prefill's observed attention, per prompt
    if args.importance == "attention":  # a raw producer does not observe by itself: ask its runner
        producer.runner.observe_window = TransferConfig().observe_tokens
    worker = producer.connector.worker
    keep = worker.set_attention_mass
    worker.set_attention_mass = lambda m: (masses.update(m), keep(m))
    for i, p in enumerate(prompts + [ppl.prefix.tolist()]):
        producer.add_request(p, SamplingParams(max_tokens=1, temperature=0), request_id=f"q{i}")
    while producer.has_unfinished():
        producer.step()
    producer.flush_saves()
    producer.close()
    ppl.attention = masses.get(f"q{len(prompts)}")
    raw_ns = Namespace(base.model_id, mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype, args.chunk_tokens)

    def decode(tenant):
        consumer = base.with_config(kv_store=store, connector=connector("consumer", tenant))
        try:
            outs = consumer.generate(held, greedy) + consumer.generate(list(needles.values()), answer)
        finally:
            consumer.close()
        return outs

    results = {}
    reference = None
    for name in ["raw"] + args.codecs:
        progress(f"quality: {name}")
        tenant = "" if name == "raw" else f"q-{name}"
        if name != "raw":
            codecs = TransferCodecs(TransferConfig(codec=name, importance=args.importance))
            ns = replace(raw_ns, tenant=tenant)
            for j, p in enumerate(prompts):
                raw_keys, keys = chunk_keys(p, raw_ns), chunk_keys(p, ns)
                for i, (rk, k) in enumerate(zip(raw_keys, keys)):
                    chunk = store.get([rk])[0]
                    store.put(k, chunk, parent=keys[i - 1] if i else None,
                              codec=codecs.for_chunk(i == 0, _slice(masses.get(f"q{j}"), i, args.chunk_tokens)))
        outs = decode(tenant)
        texts = [o.text for o in outs[len(held):]]
        row = {
            "ppl_change_pct": ppl.change(name, args.importance),
            "held_outputs": [o.output_token_ids for o in outs[:len(held)]],
            "needle": {str(n): NEEDLE_ANSWER in t for n, t in zip(needles, texts)},
            "needle_text": texts,
            "loaded_tokens": sum(o.metrics.num_loaded_tokens for o in outs),
        }
        if reference is None:
            reference = row
        row["exact_match"] = sum(a == b for a, b in zip(row["held_outputs"], reference["held_outputs"])) / len(held)
        row["token_match"] = statistics.fmean(_common_prefix(a, b) / len(b) for a, b in
                                              zip(row["held_outputs"], reference["held_outputs"]))
        results[name] = row
    store.close()
    results["reference_ppl"] = ppl.reference
    return results


def _slice(mass, i: int, chunk_tokens: int):
    return None if mass is None else mass[:, i * chunk_tokens:(i + 1) * chunk_tokens]


def _store_config():
    from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig

    return StoreConfig(host=HostTierConfig(capacity_bytes=2 << 30), disk=DiskTierConfig(enabled=False))


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Perplexity:
    """The probe's measurement (bench/probe_model.py) on the engine's KV dtype: the KV of the
    probe text's first 512 tokens, its full chunks through a codec as a producer encodes them
    (the partial last one stays exact: the consumer computes it), 512 tokens scored after it."""

    def __init__(self, model_path, base, chunk_tokens: int, prefix: int = 512, continuation: int = 512) -> None:
        import torch

        from bench import probe_model
        from engine.testing import transformers_reference

        self.probe = probe_model
        self.loaded = probe_model.LoadedModel(base.model_id, transformers_reference(model_path), None)
        ids = torch.tensor(base.tokenizer.encode(PROBE_TEXT.read_text(encoding="utf-8")))
        need = prefix + continuation
        self.prefix, self.cont = ids[:prefix], ids[prefix:need]
        self.kv = probe_model.prefix_kv(self.loaded, self.prefix)
        self.chunk_tokens = chunk_tokens
        self.reference = self._ppl(self.kv)
        self.attention = None  # the engine's observed attention over the prefix (--importance attention)

    def _ppl(self, kv) -> float:
        import torch

        logits = self.probe.continuation_logits(self.loaded, kv, self.cont)
        return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], self.cont[1:])))

    def change(self, name: str, importance: str) -> float:
        if name == "raw":
            return 0.0
        from connector.config import TransferConfig
        from connector.roles import TransferCodecs

        codecs = TransferCodecs(TransferConfig(codec=name, importance=importance))
        kv = self.kv.clone()
        c = self.chunk_tokens
        for i in range(kv.shape[2] // c):
            chunk = kv[:, :, i * c:(i + 1) * c].contiguous()
            codec = codecs.for_chunk(i == 0, _slice(self.attention, i, c))
            kv[:, :, i * c:(i + 1) * c] = codec.decode(codec.encode(chunk), tuple(chunk.shape), chunk.dtype)
        return (self._ppl(kv) / self.reference - 1.0) * 100.0


# -- the command ------------------------------------------------------------------------------------


def progress(msg: str) -> None:
    print(f"[pd] {msg}", file=sys.stderr, flush=True)


def run(args) -> int:
    import torch

    from bench.cli import UsageError
    from engine import LLM, EngineConfig
    from engine.assets import smollm2_gguf_path
    from engine.router import Request
    from engine.sampling import SamplingParams
    from engine.testing import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    args.codecs = [c for c in args.codecs.split(",") if c]
    if "raw" in args.codecs:
        raise UsageError("--codecs lists the lossy codecs; raw always runs")
    from kvstore.codecs import codec_names

    unknown = [c for c in args.codecs if c not in codec_names()]
    if unknown:
        raise UsageError(f"unknown codecs {unknown}; known: {codec_names()}")
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-pd-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        if args.quick:
            args.requests, args.max_prompt, args.max_output, args.chunk_tokens = 2, 200, 4, 32
            args.held_prompts, args.held_tokens, args.needle_lengths = 2, 100, "128"
            model = args.model or make_tiny_checkpoint(root / "tiny", max_position_embeddings=1024)
        else:
            model = args.model or smollm2_gguf_path()
        args.needle_lengths = [int(x) for x in str(args.needle_lengths).split(",") if x]
        progress(f"loading {model}")
        base = LLM(model, EngineConfig(num_blocks=512 if not args.quick else 256, block_size=16, dtype="float32"))
        corpus = corpus_tokens(base.tokenizer)
        lengths = trace_lengths(args.trace, args.requests, args.prompt_scale, args.output_scale, args.max_prompt,
                                args.max_output, args.chunk_tokens)
        requests, offset = [], 0
        for i, (p, o) in enumerate(lengths):
            if offset + p > len(corpus):
                offset = 0
            requests.append(Request(f"r{i}", corpus[offset:offset + p],
                                    SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)))
            offset += p
        mc = base.model_config
        results = {"model": str(model), "quick": args.quick, "link_gbps": args.link_gbps,
                   "chunk_tokens": args.chunk_tokens, "threads": args.threads, "importance": args.importance,
                   "kv_bytes_per_token": mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * 4,
                   "requests": [{"prompt_tokens": len(r.prompt), "output_tokens": r.params.max_tokens}
                                for r in requests]}
        runs = timing(str(model), args, root, requests)
        q = quality(base, model, args, corpus)
        base.close()
        raw_out = runs["raw"]["outputs"]
        for name, run_ in runs.items():
            run_["stream_exact_match_vs_raw"] = sum(a == b for a, b in zip(run_.pop("outputs"), raw_out)) / len(raw_out)
            if name in q:
                qr = q[name]
                run_.update(ppl_change_pct=qr["ppl_change_pct"], exact_match=qr["exact_match"],
                            quality_loaded_tokens=qr["loaded_tokens"],
                            token_match=qr["token_match"], needle=qr["needle"], needle_text=qr["needle_text"],
                            needle_text_equals_raw=qr["needle_text"] == q["raw"]["needle_text"])
        runs["colocated"]["ppl_change_pct"] = 0.0
        results["runs"] = runs
        results["reference_ppl"] = q["reference_ppl"]
        results["checks"] = checks(runs)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(format_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def outputs_equal_raw(run: dict) -> bool:
    """Every output of a run is raw's, token for token: the timed requests' streams, the held
    prompts' greedy continuations and the needle answers."""
    return (run["stream_exact_match_vs_raw"] == 1 and run.get("exact_match", 1.0) == 1
            and run.get("needle_text_equals_raw", True))


def checks(runs: dict) -> dict:
    """The issue's targets: raw TTFT vs colocated; the best codec (the largest cut in bytes over
    the link) within 2% perplexity of raw and its needle retrieval against raw's. A codec that
    changed any output is never the best, however small its perplexity change: perplexity
    is an average, and a user sees the changed text; such codecs are listed in
    ``changed_outputs`` instead."""
    raw = runs["raw"]
    out = {"raw_ttft_vs_colocated": raw["ttft_mean_s"] / runs["colocated"]["ttft_mean_s"],
           # per request (the same prompt back to back): steadier on a shared machine than the means
           "raw_ttft_vs_colocated_median": statistics.median(
               a / b for a, b in zip(raw["ttft_s"], runs["colocated"]["ttft_s"])),
           "targets": TARGETS}
    within = {name: r for name, r in runs.items() if name not in ("raw", "colocated") and r["transfer_bytes"]
              and abs(r["ppl_change_pct"]) <= TARGETS["max_ppl_change_pct"]}
    out["changed_outputs"] = [name for name, r in within.items() if not outputs_equal_raw(r)]
    ok = [(raw["transfer_bytes"] / r["transfer_bytes"], name) for name, r in within.items()
          if name not in out["changed_outputs"]]
    if ok:
        cut, best = max(ok)
        out.update(best_codec=best, best_bytes_cut=cut, best_ttft_vs_raw=runs[best]["ttft_mean_s"] / raw["ttft_mean_s"],
                   best_needle_equals_raw=runs[best]["needle"] == raw["needle"])
    return out


def format_table(r: dict) -> str:
    reqs = r["requests"]
    lines = [f"model {r['model']}  link {r['link_gbps']} GB/s  chunk {r['chunk_tokens']} tokens  "
             f"KV {r['kv_bytes_per_token']} B/token  {len(reqs)} requests one at a time, prompts "
             f"{[q['prompt_tokens'] for q in reqs]} tokens, outputs {[q['output_tokens'] for q in reqs]}",
             f"{'run':<10} {'TTFT s':>7} {'TPOT s':>7} {'2nd tok s':>9} {'TPOT 2+':>7} {'MB/req':>7} {'put s':>6} {'load s':>6} "
             f"{'ppl chg %':>9} {'exact':>5} {'tok match':>9} {'stream=raw':>10}  needle"]
    for name, x in r["runs"].items():
        needle = " ".join(f"{k}:{'y' if v else 'n'}" for k, v in x.get("needle", {}).items())
        lines.append(f"{name:<10} {x['ttft_mean_s']:7.3f} {x['tpot_mean_s']:7.3f} {x['second_token_mean_s']:9.3f} "
                     f"{x['tpot_decode_mean_s']:7.3f} "
                     f"{x['transfer_bytes'] / 1e6:7.1f} {x['put_s']:6.3f} {x['load_s']:6.3f} "
                     f"{x['ppl_change_pct']:+9.3f} {x.get('exact_match', 1.0):5.2f} {x.get('token_match', 1.0):9.2f} "
                     f"{x['stream_exact_match_vs_raw']:10.2f}  {needle}")
    c = r["checks"]
    lines.append(f"raw TTFT / colocated {c['raw_ttft_vs_colocated']:.3f} of the means, "
                 f"{c['raw_ttft_vs_colocated_median']:.3f} median per request (target <= {TARGETS['raw_ttft_vs_colocated']})")
    if "best_codec" in c:
        lines.append(f"best codec within {TARGETS['max_ppl_change_pct']}% perplexity, every output equal to raw: "
                     f"{c['best_codec']}, bytes cut {c['best_bytes_cut']:.2f}x (target >= {TARGETS['min_bytes_cut']}), "
                     f"TTFT vs raw {c['best_ttft_vs_raw']:.3f}, needle equal to raw: {c['best_needle_equals_raw']}")
    else:
        lines.append(f"no codec kept perplexity within {TARGETS['max_ppl_change_pct']}% of raw and every output "
                     "equal to raw's")
    if c["changed_outputs"]:
        lines.append(f"not a candidate, changed an output (exact, stream=raw or needle text): "
                     f"{', '.join(c['changed_outputs'])}")
    return "\n".join(lines)
