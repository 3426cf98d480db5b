"""``kvbench fetch``: free-tier fetching across replicas vs each tier alone, in one run.

Chunks are written to every replica tier, their host-RAM copies dropped, then read back
(cold: disk tiers' cached pages dropped before each read) by each tier alone and by all
together with free-tier fetching. ``ratio = aggregate / sum(single)`` says how much of
the tiers' combined bandwidth the fetcher turns into read bandwidth (1.0 = all of it).
``--emulate 200MB/s,300MB/s`` caps the tiers' bandwidth (in tier order) to show the
mechanism where, as on this machine, the real tiers share one device. An emulated tier is
one serialised device, so it gets two fetch workers (one reading while one waits), and its
files are read from the page cache so that the cap, not the shared disk, sets its speed.
Without caps the limit is the best cold raw read of every file tier's files together
(bench/limits.py), since one device holds them all here.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from bench.cli import UsageError
from bench.limits import disk_read_limit, over_limit
from kvstore.config import (
    DiskTierConfig,
    HostTierConfig,
    PfsTierConfig,
    RedisTierConfig,
    StoreConfig,
    WriteBehindConfig,
    load_config,
    parse_size,
)
from kvstore.keys import Namespace, chunk_keys

# torch and the Store are imported where they run: `kvbench --help` and a mistyped argument
# go without their seconds of start-up.
if TYPE_CHECKING:
    from kvstore.store import Store

GB = 1e9


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("fetch", help="free-tier fetching: aggregate vs single-tier read bandwidth")
    p.add_argument("--config", help="store TOML (its disk tier is the first replica tier)")
    p.add_argument("--chunks", type=int, default=48)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--pfs-dir", help="directory standing in for the shared file system (default: temporary)")
    p.add_argument("--redis", help="Redis URL: adds a Redis tier (e.g. redis://127.0.0.1:6379/0)")
    p.add_argument("--emulate", help="bandwidth caps per replica tier in order (disk, pfs, redis), e.g. 200MB/s,300MB/s")
    p.add_argument("--repeat", type=int, default=2, help="runs per figure; the best is kept")
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=run)


def _caps(text: str | None) -> list[int]:
    if not text:
        return []
    caps = [parse_size(part) for part in text.split(",") if part.strip()]
    if any(c <= 0 for c in caps):
        raise UsageError("--emulate caps must be positive")
    return caps


def _drop_caches(store: Store, keys) -> None:
    for tier in store.tiers[1:]:
        if hasattr(tier, "drop_cache"):
            for k in keys:
                tier.drop_cache(k.id)


def build_store(args, root: str, caps: list[int]) -> Store:
    """Host RAM plus the replica tiers: local disk, a PFS directory, and Redis if given."""
    from kvstore.store import Store

    cfg = load_config(args.config) if args.config else StoreConfig()
    chunk_bytes = args.layers * 2 * args.tokens * args.kv_heads * args.head_dim * 2
    budget = 4 * args.chunks * chunk_bytes
    cfg.host = HostTierConfig(capacity_bytes=max(cfg.host.capacity_bytes, 8 * chunk_bytes), prefault=False)
    if not args.config:
        cfg.disk = DiskTierConfig(path=os.path.join(root, "disk"), capacity_bytes=budget)
    cfg.disk.enabled = True
    cfg.pfs = PfsTierConfig(enabled=True, path=args.pfs_dir or os.path.join(root, "pfs"), capacity_bytes=budget)
    if args.redis:
        cfg.redis = RedisTierConfig(enabled=True, url=args.redis, key_prefix=f"kvbench:{os.getpid()}:",
                                    capacity_bytes=budget)
    cfg.write_behind = WriteBehindConfig(max_pending_bytes=cfg.host.capacity_bytes // 4)
    cfg.promote_on_read = False
    for tier_cfg, cap in zip((cfg.disk, cfg.pfs, cfg.redis), caps):
        tier_cfg.read_bytes_per_s = cap
        tier_cfg.fetch_workers = 2
    return Store(cfg)


def run(args) -> int:
    if args.chunks <= 0 or args.repeat <= 0:
        raise UsageError("--chunks and --repeat must be positive")
    caps = _caps(args.emulate)
    if len(caps) > 2 + bool(args.redis):
        raise UsageError("--emulate takes at most one cap per replica tier (disk, pfs, and redis if given)")
    root = tempfile.mkdtemp(prefix="kvbench-fetch-")
    try:
        report = _measure(args, root, caps)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _timed_read(store: Store, keys, tiers, repeat: int, cold: bool) -> float:
    best = float("inf")
    for _ in range(repeat):
        if cold:
            _drop_caches(store, keys)
        t = time.perf_counter()
        got = sum(1 for _ in store.stream(keys, tiers=tiers))
        elapsed = time.perf_counter() - t
        if got != len(keys):
            raise RuntimeError(f"fetched {got} of {len(keys)} chunks")
        best = min(best, elapsed)
    return best


def _measure(args, root: str, caps: list[int]) -> dict:
    import torch

    ns = Namespace("kvbench-fetch", args.layers, args.kv_heads, args.head_dim, "float16", args.tokens)
    keys = chunk_keys(list(range(args.chunks * args.tokens)), ns)
    chunk = torch.randn(ns.chunk_shape).half()
    with build_store(args, root, caps) as store:
        for k in keys:
            store.put(k, chunk, durable=True)
        store.drop(keys, store.first.name)
        replica_tiers = [t.name for t in store.tiers[1:]]
        if store.stats().write_behind_dropped:
            raise RuntimeError("some copies failed; see the log")
        total = len(keys) * chunk.numel() * chunk.element_size()
        single = {name: total / _timed_read(store, keys, [name], args.repeat, not caps) / GB for name in replica_tiers}
        before = {n: s.hits for n, s in store.stats().tiers.items()}
        aggregate = total / _timed_read(store, keys, replica_tiers, args.repeat, not caps) / GB
        after = store.stats().tiers
        share = {n: (after[n].hits - before[n]) / (args.repeat * len(keys)) for n in replica_tiers}
        files = [str(t.path_of(k.id)) for t in store.tiers[1:] if hasattr(t, "path_of") for k in keys]
        # one device holds every file tier here: its best cold read bounds them all together
        limit = disk_read_limit(files) if files and not caps else None
    return {
        "limit": limit.as_dict() if limit else None,
        "over_limit": over_limit({"aggregate": aggregate, **single}, limit) if limit else [],
        "chunk_bytes": chunk.numel() * chunk.element_size(),
        "chunks": len(keys),
        "emulated_caps_bytes_per_s": dict(zip(replica_tiers, caps)),
        "single_gbps": single,
        "aggregate_gbps": aggregate,
        "sum_single_gbps": sum(single.values()),
        "ratio": aggregate / sum(single.values()),
        "share_of_chunks": share,
    }


def _print(r: dict) -> None:
    caps = ", ".join(f"{tier} {cap / 1e6:g} MB/s" for tier, cap in r["emulated_caps_bytes_per_s"].items())
    print(f"{r['chunks']} chunks of {r['chunk_bytes'] / 2**20:.2f} MiB; emulated read caps: {caps or 'none'}")
    for name, g in r["single_gbps"].items():
        print(f"  {name:<6} alone     {g:7.3f} GB/s   share in aggregate {r['share_of_chunks'][name]:.0%}")
    print(f"  all tiers (free-tier) {r['aggregate_gbps']:7.3f} GB/s   sum of single {r['sum_single_gbps']:.3f}   ratio {r['ratio']:.2f}")
    if r["limit"]:
        print(f"  limit: cold raw read of every tier's files {r['limit']['gbps']:.3f} GB/s ({r['limit']['config']}); "
              f"aggregate/limit {r['aggregate_gbps'] / r['limit']['gbps']:.2f}")
    for w in r["over_limit"]:
        print(f"warning: {w}", file=sys.stderr)
