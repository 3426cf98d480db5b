"""``kvbench replay``: a block trace through the real Store with real tiers, per eviction policy.

Each request's blocks become chunk keys (one key per trace id, so equal ids are equal
prefixes). A request looks up its longest stored prefix, loads it (free-tier fetch into
reused buffers, timed), and puts every block it missed (a missing block is always stored,
with its parent), as an engine with a connector would. Requests run back to back: arrival
times are compressed away. Payloads are synthetic, sized like the configured model's chunks.

After each request the store's write-behind is flushed, so the next request sees every
copy written and the outcome does not depend on thread timing (without it, repeated runs of
one configuration differed by up to 3 points of hits).

Reported per policy: hit ratio of block accesses per serving tier (prefix-usable: a block
after the first miss is recomputed, not loaded), bytes read and written, and modelled TTFT
per request = measured load time + missed tokens / ``--prefill-tok-s`` (the prefill cost
model; calibrate it with ``kvbench engine`` or a real engine's prefill throughput).
Capacities are percentages of the replayed requests' distinct blocks, as in ``kvbench policies``.
Where the trace labels its requests (``workload:...`` mixes label each with its tenant's
kind), TTFT and the prefix hit ratio are reported per class too: a policy's hits are worth
what they save in prefill, and its gains on one kind of request may be losses on another.

A policy name ending in ``+compress`` (e.g. ``default+compress``) runs that policy with joint
compression and eviction (kvstore/store/placement.py): a victim may stay in its tier re-encoded by a
codec the ``--verdicts`` file allows, valued with the same prefill cost model, and a copy
written behind to the disk may be encoded there. ``NAME+CODEC`` (e.g. ``lru+int8``) puts every
chunk in that codec: fixed-ratio compression. Payloads are random fp16 (lossy codecs shrink
them as they would real KV; lossless lz4 does not, as on real fp16 KV), or with ``--payloads
real`` the KV SmolLM2 computes on real prose; the quality cost comes from the verdict file,
and the replayed chunks are stored under the model id it names (verdicts hold per model).

With ``--read-gbps``, time is modelled rather than measured, for tiers this machine does not
have (a disk throttled to 1 GB/s behind no page cache) and for a model larger than the chunks
replayed: every byte a request reads counts as ``--model-kv-bytes-per-token`` x
``--model-tokens`` / (the replayed chunk's bytes) bytes of the modelled model, read at the
tier's bandwidth, tiers in parallel (free-tier fetching); lossy chunks add their decode at
``--decode-gbps``; each missed block costs ``--model-tokens`` / ``--prefill-tok-s``. Placement
plans with the same bandwidths and costs, so it decides in the modelled world it is judged in.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from bench.cli import UsageError
from bench.progress import Progress
from bench.traces import load_trace
from kvstore.config import (DiskTierConfig, HostTierConfig, PfsTierConfig, PlacementConfig, ReplicationConfig,
                            StoreConfig, known_codecs)
from kvstore.keys import ChunkKey, Namespace
from kvstore.policies import POLICIES

# torch (with the codecs, placement and the Store) is imported where it runs: `kvbench replay`
# with a mistyped argument or a bad trace fails without its ~1 s of start-up.
if TYPE_CHECKING:
    import torch


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("replay", help="replay a trace through the real Store and its tiers")
    p.add_argument("--trace", required=True,
                   help="trace file (Mooncake JSONL or text), synthetic[:k=v,...] or workload:NAME[:k=v,...]")
    p.add_argument("--policies", default="lru,arc,default,default+compress",
                   help="eviction policies to compare; NAME+compress adds joint compression")
    p.add_argument("--requests", type=int, default=1000, help="replay the first N requests")
    p.add_argument("--host-pct", type=float, default=1.0, help="host RAM capacity, %% of distinct blocks")
    p.add_argument("--disk-pct", type=float, default=10.0, help="local disk capacity, %% of distinct blocks")
    p.add_argument("--pfs-pct", type=float, default=0.0,
                   help="a PFS tier (a directory) of this capacity, %% of distinct blocks (0: none)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128, help="tokens per chunk (one trace block)")
    p.add_argument("--prefill-tok-s", type=float, default=20000.0, help="prefill cost model: tokens per second")
    p.add_argument("--verdicts", default=str(DEFAULT_VERDICTS), help="codec verdict file for +compress")
    p.add_argument("--quality-weight-s", type=float, default=PlacementConfig.quality_weight_s,
                   help="placement's lambda: seconds one percent of perplexity change costs per use")
    p.add_argument("--payloads", choices=["random", "real"], default="random",
                   help="chunk values: random fp16, or SmolLM2's KV of real prose (its shape: --layers, "
                        "--kv-heads and --head-dim are then the model's)")
    p.add_argument("--read-gbps", metavar="host=G,disk=G",
                   help="model time instead of measuring it: each tier's read bandwidth, GB/s of modelled KV")
    p.add_argument("--model-kv-bytes-per-token", type=int,
                   help="with --read-gbps: the modelled model's KV bytes per token (default: the replayed chunks')")
    p.add_argument("--model-tokens", type=int, help="with --read-gbps: tokens a trace block stands for (default --tokens)")
    p.add_argument("--decode-gbps", type=float,
                   help="with --read-gbps: lossy decode speed, GB/s of raw modelled KV (default: int8 measured here)")
    p.add_argument("--dir", help="directory for the disk tier (default: temporary)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=run)


COMPRESS = "+compress"
DEFAULT_VERDICTS = Path(__file__).parent / "data" / "verdicts" / "SmolLM2-135M-Instruct.Q4_1.float16.json"
PROSE = Path(__file__).parent / "data" / "probe_prose.txt"


@dataclass(frozen=True)
class TimeModel:
    """Modelled time, per byte of the replayed chunks (see the module docstring)."""

    read_bytes_per_s: dict[str, float]  # tier -> replayed bytes per second
    decode_bytes_per_s: float  # raw replayed bytes decoded per second
    recompute_s: float  # one missed block
    scale: float  # modelled bytes per replayed byte

    def load_s(self, bytes_read: dict[str, int], lossy_raw_bytes: int) -> float:
        unknown = [t for t, n in bytes_read.items() if n and t not in self.read_bytes_per_s]
        if unknown:
            raise UsageError(f"--read-gbps: no bandwidth for tiers {unknown}")
        parallel = max((n / self.read_bytes_per_s[t] for t, n in bytes_read.items() if n), default=0.0)
        return parallel + lossy_raw_bytes / self.decode_bytes_per_s


@dataclass(frozen=True)
class Variant:
    """A policy as named on the command line: ``NAME[+compress][+replicate][+CODEC]``."""

    name: str
    policy: str
    compress: bool
    replicate: bool
    codec: str | None


def parse_variant(name: str) -> Variant:
    policy, *mods = name.split("+")
    codecs = [m for m in mods if m not in ("compress", "replicate")]
    if policy != "default" and policy not in POLICIES:
        raise UsageError(f"unknown policies [{name!r}]; known: default, {', '.join(sorted(POLICIES))}")
    if len(codecs) > 1 or any(c not in known_codecs() for c in codecs):
        raise UsageError(f"{name}: after '+', 'compress', 'replicate' or one codec of {known_codecs()}")
    return Variant(name, policy, "compress" in mods, "replicate" in mods, codecs[0] if codecs else None)


def real_chunks(tokens: int, max_tokens: int = 1024) -> list[torch.Tensor]:
    """SmolLM2-135M's fp16 KV of the probe prose, cut into chunks of ``tokens`` tokens."""
    from bench import probe_model
    from engine.assets import smollm2_gguf_path

    loaded = probe_model.load_model(smollm2_gguf_path())
    ids = probe_model.token_ids(loaded, PROSE.read_text())[:max_tokens]
    if len(ids) < tokens:
        raise UsageError(f"--tokens {tokens}: the probe text has only {len(ids)} tokens")
    kv = probe_model.prefix_kv(loaded, ids).half()
    return [kv[:, :, i:i + tokens].contiguous() for i in range(0, len(ids) - tokens + 1, tokens)]


def int8_decode_bytes_per_s(chunk: torch.Tensor) -> float:
    """int8's decode speed on this machine for one chunk: raw bytes out per second, best of 5
    after a warm-up (noisy where other work shares the cores: give ``--decode-gbps`` then)."""
    import torch

    from kvstore.codecs import get_codec

    codec = get_codec("int8")
    payload, out = codec.encode(chunk), torch.empty_like(chunk)
    codec.decode_into(payload, out)
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        codec.decode_into(payload, out)
        best = min(best, time.perf_counter() - started)
    return chunk.numel() * chunk.element_size() / best


def time_model(args, chunk: torch.Tensor) -> TimeModel | None:
    if args.read_gbps is None:
        return None
    try:
        gbps = {t: float(v) for t, v in (item.split("=") for item in args.read_gbps.split(","))}
    except ValueError:
        raise UsageError(f"--read-gbps: expected host=G,disk=G, got {args.read_gbps!r}") from None
    if not gbps or any(v <= 0 for v in gbps.values()) or (args.decode_gbps is not None and args.decode_gbps <= 0):
        raise UsageError("--read-gbps and --decode-gbps must be positive")
    raw = chunk.numel() * chunk.element_size()
    tokens = args.model_tokens or chunk.shape[2]
    per_token = args.model_kv_bytes_per_token or raw // chunk.shape[2]
    scale = tokens * per_token / raw  # modelled bytes per replayed byte
    decode = args.decode_gbps * 1e9 if args.decode_gbps else int8_decode_bytes_per_s(chunk)  # modelled bytes/s
    return TimeModel({t: v * 1e9 / scale for t, v in gbps.items()}, decode / scale, tokens / args.prefill_tok_s, scale)


def _key(ns: Namespace, block_id) -> ChunkKey:
    return ChunkKey(ns, hashlib.blake2b(str(block_id).encode(), digest_size=16).digest())


def _percentiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {"mean_s": float(a.mean()), "p50_s": float(np.percentile(a, 50)),
            "p90_s": float(np.percentile(a, 90)), "p99_s": float(np.percentile(a, 99))}


def replay_one(requests, variant: Variant, args, ns: Namespace, root: Path, progress: Progress,
               payloads: list[torch.Tensor], model: TimeModel | None, classes: list[str] | None = None) -> dict:
    """One policy's replay; ``classes`` labels each request for the per-class figures."""
    import torch

    from kvstore.store import Store

    chunk = payloads[0]
    raw_bytes = chunk.numel() * chunk.element_size()
    blob = raw_bytes + 4096
    distinct = len({b for r in requests for b in r})
    placement = PlacementConfig(enabled=variant.compress, verdicts=[args.verdicts] if variant.compress else [],
                                quality_weight_s=args.quality_weight_s, prefill_tokens_per_s=args.prefill_tok_s)
    if model is not None:
        placement.prefill_tokens_per_s = ns.chunk_tokens / model.recompute_s
        placement.host_read_bytes_per_s = int(model.read_bytes_per_s.get("host", 0))
        placement.disk_read_bytes_per_s = int(model.read_bytes_per_s.get("disk", 0))
        placement.pfs_read_bytes_per_s = int(model.read_bytes_per_s.get("pfs", 0))
        placement.decode_bytes_per_s = max(1, int(model.decode_bytes_per_s))
    cfg = StoreConfig(
        host=HostTierConfig(capacity_bytes=max(4, int(distinct * args.host_pct / 100)) * blob, page_bytes=4096, prefault=False),
        disk=DiskTierConfig(path=str(root / variant.name / "disk"), capacity_bytes=max(4, int(distinct * args.disk_pct / 100)) * blob),
        pfs=PfsTierConfig(enabled=args.pfs_pct > 0, path=str(root / variant.name / "pfs"),
                          capacity_bytes=max(4, int(distinct * args.pfs_pct / 100)) * blob),
        eviction_policy=variant.policy,
        placement=placement,
        replication=ReplicationConfig(mode="utility" if variant.replicate else "all"),
    )
    longest = max(len(r) for r in requests)
    outs = [torch.empty_like(chunk) for _ in range(longest)]
    recompute_s = _recompute_s(model, ns, args)
    ttft, served, accesses = [], {}, 0
    by_class: dict[str, dict[str, list]] = {}  # class -> {"ttft": [...], "blocks": [hit, accessed]}
    with Store(cfg) as store:
        for done, request in enumerate(requests, 1):
            keys = [_key(ns, b) for b in request]
            before = store.stats().tiers
            start = time.perf_counter()
            present = store.lookup(keys)
            hit = store.get_many_into(keys[:present], outs[:present])
            load_s = time.perf_counter() - start
            after = store.stats().tiers
            if model is not None:
                load_s = model.load_s({n: after[n].bytes_read - before[n].bytes_read for n in after},
                                      raw_bytes * sum(after[n].lossy_hits - before[n].lossy_hits for n in after))
            for i in range(hit, len(keys)):
                store.put(keys[i], payloads[_slot(request[i], len(payloads))], parent=keys[i - 1] if i else None,
                          codec=variant.codec)
            store.flush()  # the next request sees every copy written: outcomes do not depend on thread timing
            for name in after:
                served[name] = served.get(name, 0) + after[name].hits - before[name].hits
            accesses += len(keys)
            ttft.append(load_s + (len(keys) - hit) * recompute_s)
            if classes is not None:
                mine = by_class.setdefault(classes[done - 1], {"ttft": [], "blocks": [0, 0]})
                mine["ttft"].append(ttft[-1])
                mine["blocks"][0] += hit
                mine["blocks"][1] += len(keys)
            progress.step(what=variant.name)
        store.flush()
        stats = store.stats().tiers
    hits = sum(served.values())
    lossy = sum(s.lossy_hits for s in stats.values())
    return {
        "hit_pct": {name: 100 * n / accesses for name, n in served.items()},
        "total_hit_pct": 100 * hits / accesses,
        "bytes_read": {n: s.bytes_read for n, s in stats.items()},
        "bytes_written": {n: s.bytes_written for n, s in stats.items()},
        "lossy_hit_pct": 100 * lossy / accesses,
        "ppl_change_bound_pct": _ppl_bound(args.verdicts, ns.model_id, variant, lossy, accesses),
        "recodes": {n: s.recodes for n, s in stats.items()},
        "ttft": _percentiles(ttft),
        "by_class": {c: {"requests": len(v["ttft"]), "prefix_hit_pct": 100 * v["blocks"][0] / v["blocks"][1],
                         "ttft": _percentiles(v["ttft"])} for c, v in sorted(by_class.items())},
    }


def _recompute_s(model: TimeModel | None, ns: Namespace, args) -> float:
    """What a missed block costs: modelled, or the replayed chunk's tokens at the prefill rate."""
    return model.recompute_s if model is not None else ns.chunk_tokens / args.prefill_tok_s


def _slot(block_id, n: int) -> int:
    return int.from_bytes(hashlib.blake2b(str(block_id).encode(), digest_size=8).digest(), "little") % n


def _ppl_bound(verdicts: str, model_id: str, variant: Variant, lossy: int, accesses: int) -> float:
    """Perplexity change to expect, at most: the share of accessed blocks served lossy times the
    worst perplexity change of the codecs the variant may have served them in (the probe's
    figure for a prefix whose every chunk is in that codec)."""
    from kvstore.store.placement import load_verdicts

    if not lossy:
        return 0.0
    allowed = load_verdicts([verdicts]).get((model_id, "float16"), {})
    names = [variant.codec] if variant.codec else [c for c in PlacementConfig().codecs if c in allowed]
    worst = max((allowed.get(c, math.nan) for c in names), default=math.nan)
    return lossy / accesses * worst


def _verdicts_model(verdicts: str) -> str:
    """The model the verdict file was measured on: the replayed chunks stand for its KV, so
    they are stored under its id and placement applies the verdicts to them."""
    from kvstore.store.placement import load_verdicts

    return next(iter(load_verdicts([verdicts])))[0]


def floor(requests, recompute_s: float) -> dict:
    """What no policy or encoding can beat: an unbounded cache that loads in no time, so a
    request recomputes only the blocks from its first never-seen one on (prefix-usable)."""
    seen: set = set()
    ttft, hits, accesses = [], 0, 0
    for request in requests:
        hit = next((i for i, b in enumerate(request) if b not in seen), len(request))
        seen.update(request)
        hits += hit
        accesses += len(request)
        ttft.append((len(request) - hit) * recompute_s)
    return {"hit_pct": 100 * hits / accesses, "ttft_mean_s": float(np.mean(ttft))}


def run(args) -> int:
    if args.requests <= 0 or args.prefill_tok_s <= 0:
        raise UsageError("--requests and --prefill-tok-s must be positive")
    variants = [parse_variant(p.strip()) for p in args.policies.split(",") if p.strip()]
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests]
    model_id = _verdicts_model(args.verdicts)
    if args.payloads == "real":
        payloads = real_chunks(args.tokens)
        layers, _, _, heads, dim = payloads[0].shape
        ns = Namespace(model_id, layers, heads, dim, "float16", args.tokens)
    else:
        import torch

        ns = Namespace(model_id, args.layers, args.kv_heads, args.head_dim, "float16", args.tokens)
        payloads = [torch.randn(ns.chunk_shape).half()]
    model = time_model(args, payloads[0])
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvbench-replay-"))
    results = {}
    progress = Progress(len(variants) * len(requests), "requests replayed")
    try:
        for variant in variants:
            results[variant.name] = replay_one(requests, variant, args, ns, root, progress, payloads, model,
                                               None if trace.classes is None else trace.classes[: args.requests])
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    recompute_s = _recompute_s(model, ns, args)
    report = {"trace": trace.name, "requests": len(requests), "host_pct": args.host_pct, "pfs_pct": args.pfs_pct,
              "floor": floor(requests, recompute_s),
              "disk_pct": args.disk_pct, "prefill_tok_s": args.prefill_tok_s, "payloads": args.payloads,
              "chunk_shape": list(ns.chunk_shape), "quality_weight_s": args.quality_weight_s,
              "time_model": None if model is None else {
                  "read_gbps": args.read_gbps, "model_kv_bytes_per_token": args.model_kv_bytes_per_token,
                  "model_tokens": args.model_tokens or args.tokens, "recompute_s_per_block": model.recompute_s,
                  "decode_gbps": model.decode_bytes_per_s * model.scale / 1e9,
                  "decode_measured_here": not args.decode_gbps},
              "policies": results}
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict) -> None:
    print(f"{report['trace']}: {report['requests']} requests; host {report['host_pct']}%, "
          f"disk {report['disk_pct']}%{', PFS ' + str(report['pfs_pct']) + '%' if report['pfs_pct'] else ''} of distinct blocks")
    if report["time_model"]:
        m = report["time_model"]
        print(f"time modelled: read {m['read_gbps']} GB/s, decode {m['decode_gbps']:.2f} GB/s"
              f"{' (int8, measured here)' if m['decode_measured_here'] else ''}, "
              f"{m['recompute_s_per_block'] * 1e3:.1f} ms to recompute a block")
    f = report["floor"]
    print(f"floor (an unbounded cache loading in no time): {f['hit_pct']:.2f}% hits, TTFT mean {f['ttft_mean_s']:.4f} s")
    print(f"{'policy':<18} {'host hit%':>9} {'disk hit%':>9} {'pfs hit%':>8} {'lossy%':>7} {'ppl<=%':>7} {'read MB':>8} {'written MB':>10} "
          f"{'TTFT mean':>10} {'p50':>8} {'p90':>8} {'p99':>8}")
    for name, r in report["policies"].items():
        h, t = r["hit_pct"], r["ttft"]
        read, written = sum(r["bytes_read"].values()) / 1e6, sum(r["bytes_written"].values()) / 1e6
        print(f"{name:<18} {h.get('host', 0):9.2f} {h.get('disk', 0):9.2f} {h.get('pfs', 0):8.2f} {r['lossy_hit_pct']:7.2f} "
              f"{r['ppl_change_bound_pct']:7.3f} {read:8.1f} "
              f"{written:10.1f} {t['mean_s']:10.4f} {t['p50_s']:8.4f} {t['p90_s']:8.4f} {t['p99_s']:8.4f}")
    classes = sorted({c for r in report["policies"].values() for c in r["by_class"]})
    if classes:
        print("per request class: prefix hit % / TTFT mean / p50 / p90 (s)")
        print(f"{'policy':<18} " + " ".join(f"{c + ' (' + str(_requests(report, c)) + ')':>30}" for c in classes))
        for name, r in report["policies"].items():
            cells = []
            for c in classes:
                v = r["by_class"].get(c)
                cells.append(f"{'-':>30}" if v is None else
                             f"{v['prefix_hit_pct']:6.2f} {v['ttft']['mean_s']:7.4f} {v['ttft']['p50_s']:7.4f} {v['ttft']['p90_s']:7.4f}")
            print(f"{name:<18} " + " ".join(cells))


def _requests(report: dict, cls: str) -> int:
    return next(r["by_class"][cls]["requests"] for r in report["policies"].values() if cls in r["by_class"])
