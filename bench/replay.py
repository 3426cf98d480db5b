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
compression and eviction (kvstore/placement.py): a victim may stay in its tier re-encoded by a
codec the ``--verdicts`` file allows, valued with the same prefill cost model. Synthetic
payloads are random fp16, so lossy codecs shrink them as they would real KV (lossless lz4 does
not, as on real fp16 KV), while the quality cost comes from the verdict file's model.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bench.cli import UsageError
from bench.progress import Progress
from bench.traces import load_trace
from kvstore.config import DiskTierConfig, HostTierConfig, PlacementConfig, StoreConfig
from kvstore.keys import ChunkKey, Namespace
from kvstore.policies import POLICIES
from kvstore.store import Store


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("replay", help="replay a trace through the real Store and its tiers")
    p.add_argument("--trace", required=True,
                   help="trace file (Mooncake JSONL or text), synthetic[:k=v,...] or workload:NAME[:k=v,...]")
    p.add_argument("--policies", default="lru,arc,default,default+compress",
                   help="eviction policies to compare; NAME+compress adds joint compression")
    p.add_argument("--requests", type=int, default=1000, help="replay the first N requests")
    p.add_argument("--host-pct", type=float, default=1.0, help="host RAM capacity, %% of distinct blocks")
    p.add_argument("--disk-pct", type=float, default=10.0, help="local disk capacity, %% of distinct blocks")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128, help="tokens per chunk (one trace block)")
    p.add_argument("--prefill-tok-s", type=float, default=20000.0, help="prefill cost model: tokens per second")
    p.add_argument("--verdicts", default=str(DEFAULT_VERDICTS), help="codec verdict file for +compress")
    p.add_argument("--quality-weight-s", type=float, default=PlacementConfig.quality_weight_s,
                   help="placement's lambda: seconds one percent of perplexity change costs per use")
    p.add_argument("--dir", help="directory for the disk tier (default: temporary)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=run)


COMPRESS = "+compress"
DEFAULT_VERDICTS = Path(__file__).parent / "data" / "verdicts" / "SmolLM2-135M-Instruct.Q4_1.float16.json"


def _key(ns: Namespace, block_id) -> ChunkKey:
    return ChunkKey(ns, hashlib.blake2b(str(block_id).encode(), digest_size=16).digest())


def _percentiles(values: list[float]) -> dict[str, float]:
    a = np.asarray(values)
    return {"mean_s": float(a.mean()), "p50_s": float(np.percentile(a, 50)),
            "p90_s": float(np.percentile(a, 90)), "p99_s": float(np.percentile(a, 99))}


def replay_one(requests, policy: str, args, ns: Namespace, root: Path, progress: Progress,
               classes: list[str] | None = None) -> dict:
    """One policy's replay; ``classes`` labels each request for the per-class figures."""
    chunk = torch.randn(ns.chunk_shape).half()
    blob = chunk.numel() * chunk.element_size() + 4096
    distinct = len({b for r in requests for b in r})
    compress = policy.endswith(COMPRESS)
    cfg = StoreConfig(
        host=HostTierConfig(capacity_bytes=max(4, int(distinct * args.host_pct / 100)) * blob, page_bytes=4096, prefault=False),
        disk=DiskTierConfig(path=str(root / policy), capacity_bytes=max(4, int(distinct * args.disk_pct / 100)) * blob),
        eviction_policy=policy.removesuffix(COMPRESS),
        placement=PlacementConfig(enabled=compress, verdicts=[args.verdicts] if compress else [],
                                  quality_weight_s=args.quality_weight_s, prefill_tokens_per_s=args.prefill_tok_s),
    )
    longest = max(len(r) for r in requests)
    outs = [torch.empty_like(chunk) for _ in range(longest)]
    ttft, served, accesses = [], {}, 0
    by_class: dict[str, dict[str, list]] = {}  # class -> {"ttft": [...], "blocks": [hit, accessed]}
    with Store(cfg) as store:
        for done, request in enumerate(requests, 1):
            keys = [_key(ns, b) for b in request]
            before = {n: s.hits for n, s in store.stats().tiers.items()}
            start = time.perf_counter()
            present = store.lookup(keys)
            hit = store.get_many_into(keys[:present], outs[:present])
            load_s = time.perf_counter() - start
            for i in range(hit, len(keys)):
                store.put(keys[i], chunk, parent=keys[i - 1] if i else None)
            store.flush()  # the next request sees every copy written: outcomes do not depend on thread timing
            after = store.stats().tiers
            for name in after:
                served[name] = served.get(name, 0) + after[name].hits - before[name]
            accesses += len(keys)
            ttft.append(load_s + (len(keys) - hit) * ns.chunk_tokens / args.prefill_tok_s)
            if classes is not None:
                mine = by_class.setdefault(classes[done - 1], {"ttft": [], "blocks": [0, 0]})
                mine["ttft"].append(ttft[-1])
                mine["blocks"][0] += hit
                mine["blocks"][1] += len(keys)
            progress.step(what=policy)
        store.flush()
        stats = store.stats().tiers
    return {
        "hit_pct": {name: 100 * n / accesses for name, n in served.items()},
        "total_hit_pct": 100 * sum(served.values()) / accesses,
        "bytes_read": {n: s.bytes_read for n, s in stats.items()},
        "bytes_written": {n: s.bytes_written for n, s in stats.items()},
        "lossy_hit_pct": 100 * sum(s.lossy_hits for s in stats.values()) / accesses,
        "recodes": {n: s.recodes for n, s in stats.items()},
        "ttft": _percentiles(ttft),
        "by_class": {c: {"requests": len(v["ttft"]), "prefix_hit_pct": 100 * v["blocks"][0] / v["blocks"][1],
                         "ttft": _percentiles(v["ttft"])} for c, v in sorted(by_class.items())},
    }


def run(args) -> int:
    if args.requests <= 0 or args.prefill_tok_s <= 0:
        raise UsageError("--requests and --prefill-tok-s must be positive")
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p.removesuffix(COMPRESS) != "default" and p.removesuffix(COMPRESS) not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policies {unknown}; known: default, {', '.join(sorted(POLICIES))}")
    trace = load_trace(args.trace)
    requests = trace.requests[: args.requests]
    ns = Namespace("kvbench-replay", args.layers, args.kv_heads, args.head_dim, "float16", args.tokens)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="kvbench-replay-"))
    results = {}
    progress = Progress(len(names) * len(requests), "requests replayed")
    try:
        for policy in names:
            results[policy] = replay_one(requests, policy, args, ns, root, progress,
                                         None if trace.classes is None else trace.classes[: args.requests])
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    report = {"trace": trace.name, "requests": len(requests), "host_pct": args.host_pct,
              "disk_pct": args.disk_pct, "prefill_tok_s": args.prefill_tok_s,
              "quality_weight_s": args.quality_weight_s, "policies": results}
    _print(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def _print(report: dict) -> None:
    print(f"{report['trace']}: {report['requests']} requests; host {report['host_pct']}%, "
          f"disk {report['disk_pct']}% of distinct blocks")
    print(f"{'policy':<18} {'host hit%':>9} {'disk hit%':>9} {'lossy%':>7} {'read MB':>8} {'written MB':>10} "
          f"{'TTFT mean':>10} {'p50':>8} {'p90':>8} {'p99':>8}")
    for name, r in report["policies"].items():
        h, t = r["hit_pct"], r["ttft"]
        read, written = sum(r["bytes_read"].values()) / 1e6, sum(r["bytes_written"].values()) / 1e6
        print(f"{name:<18} {h.get('host', 0):9.2f} {h.get('disk', 0):9.2f} {r['lossy_hit_pct']:7.2f} {read:8.1f} "
              f"{written:10.1f} {t['mean_s']:10.4f} {t['p50_s']:8.4f} {t['p90_s']:8.4f} {t['p99_s']:8.4f}")
    classes = sorted({c for r in report["policies"].values() for c in r["by_class"]})
    if classes:
        print(f"per request class: prefix hit % / TTFT mean / p50 / p90 (s)")
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
