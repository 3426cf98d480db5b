"""``kvbench peers``: our Store and LMCache's in-process StorageManager (LocalCPUBackend +
LocalDiskBackend) on exactly the same work, in the same process and run, beside the limits.

The work (defaults: 24 chunks of 32 MiB, fp16, 256 tokens x 32 layers x 8 KV heads x 128):
put every chunk (a put returns once the chunk is in host RAM; the disk copy is written
behind and waited for outside the timing; each put is timed too, for its median and P99
beside the throughput; our Store runs write-behind's defaults, as users do); get them from host RAM into 4 rotating,
pre-touched destination tensors; drop the host copies and the page cache of the disk copies
(checked dropped), then read them cold from disk into the same destinations. The get from
host RAM, which can be made again, is timed as often as each memcpy configuration of the
limit, the shortest kept (bench/limits.py ``best_time``), for both systems alike. Limits
(bench/limits.py) are measured in each system's turn on the same buffers and files: memcpy
just before and right after its get from host RAM and again after its cold get (the best
kept), raw reads of its files just before and just after its cold get.

``--rounds`` rounds (bench/rounds.py), each running both systems, which goes first alternating;
a round's limit is the best of every measurement taken in it. Every figure is printed as its
median over the rounds (min-max), every ratio (ours / LMCache, a figure / its round's limit)
as the median of the per-round ratios. The JSON keeps every round, and flags any round in
which a figure beat its round's limit by more than 5%.

LMCache is optional and never a dependency: ``pip install lmcache==0.5.6`` beside CPU torch
(docs/benchmarks.md says how). ``--peer none`` runs ours and the limits alone.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time

import numpy as np

from bench.cli import UsageError
from bench.limits import Limit, best_over, best_time, disk_read_limit, drop_cache, memcpy_limit
from bench.rounds import ROUNDS, Spread, in_turns, limit_summary, over_limit, over_limit_lines, ratio
from bench.tiers import READ_FORMS
from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys

GB = 1e9
PHASES = ("put", "host_get", "cold_get")
LMCACHE_VERSION = "0.5.6"
INSTALL = (f"LMCache is not installed: pip install lmcache=={LMCACHE_VERSION} in a venv whose torch is CPU torch "
           f"(pin it: pip install torch==<this torch> first, then lmcache with a constraint file pinning torch), "
           f"then pip install -e <this repository> there; see docs/benchmarks.md")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("peers", help="our Store beside LMCache's StorageManager on the same work, with limits")
    p.add_argument("--peer", default="lmcache", choices=["lmcache", "none"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--chunks", type=int, default=24)
    p.add_argument("--destinations", type=int, default=4, help="rotating destination tensors of a get")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="interleaved rounds of both systems and the limits; figures are their medians")
    p.add_argument("--dir", default=None, help="directory for the disk copies (default: a temporary one)")
    p.add_argument("--direct-writes", action="store_true", help="our disk copies written with O_DIRECT (disk.direct_writes)")
    p.add_argument("--read-form", default="buffered", choices=list(READ_FORMS),
                   help="how our disk tier reads: through the page cache, with O_DIRECT, or auto (disk.o_direct)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    p.set_defaults(func=run)


class Ours:
    name = "ours (Store)"

    def __init__(self, ns: Namespace, chunks: int, chunk_bytes: int, root: str, direct_writes: bool = False,
                 read_form: str = "buffered") -> None:
        from kvstore.store import Store

        room = chunks * (chunk_bytes + (1 << 20))
        self.store = Store(StoreConfig(
            host=HostTierConfig(capacity_bytes=2 * room),
            disk=DiskTierConfig(path=os.path.join(root, "ours"), capacity_bytes=2 * room, direct_writes=direct_writes,
                                o_direct=READ_FORMS[read_form]),
        ))
        self.keys = chunk_keys(list(range(chunks * ns.chunk_tokens)), ns)
        direct = getattr(self.store.tier("disk"), "o_direct", False)
        self.read_form = f"{'O_DIRECT' if direct else 'buffered'}, {self.store.fetch_workers['disk']} in flight"

    def put(self, i: int, chunk) -> None:
        self.store.put(self.keys[i], chunk)

    def settle(self) -> None:
        if not self.store.flush(300):
            raise RuntimeError("our write-behind did not finish within 300 s")

    def get(self, outs) -> None:
        n = len(outs)
        for i in range(0, len(self.keys), n):
            batch = self.keys[i : i + n]
            if self.store.get_many_into(batch, outs[: len(batch)]) != len(batch):
                raise RuntimeError("our Store lost a chunk")

    def drop_host(self) -> list[str]:
        self.store.drop(self.keys, "host")
        return [str(self.store.tier("disk").path_of(k.id)) for k in self.keys]

    def reset(self) -> None:
        self.store.delete(self.keys)

    def close(self) -> None:
        self.store.close()


class LMCachePeer:
    name = f"LMCache {LMCACHE_VERSION}"

    def __init__(self, ns: Namespace, chunks: int, chunk_bytes: int, root: str, rounds: int) -> None:
        import torch
        from lmcache.utils import CacheEngineKey
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.event_manager import EventManager
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.storage_manager import StorageManager

        gib = 2 * chunks * (chunk_bytes + (1 << 20)) / 2**30
        self.path = os.path.join(root, "lmcache") + "/"
        os.makedirs(self.path, exist_ok=True)
        # its disk backend does not give back the room of removed chunks to a later put of the
        # same keys: each round puts new keys, into room for every round
        config = LMCacheEngineConfig.from_defaults(chunk_size=ns.chunk_tokens, local_cpu=True, max_local_cpu_size=gib,
                                                   local_disk=self.path, max_local_disk_size=gib * rounds)
        self.shape = (ns.num_layers, 2, ns.chunk_tokens, ns.num_kv_heads, ns.head_dim)
        self.size = torch.Size(self.shape)
        meta = LMCacheMetadata(model_name="kvbench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=ns.torch_dtype, kv_shape=self.shape)
        self.fmt = MemoryFormat.KV_2LTD
        self.dtype = ns.torch_dtype
        self.sm = StorageManager(config, meta, EventManager())
        self.disk = self.sm.storage_backends["LocalDiskBackend"]
        self._key = lambda i: CacheEngineKey("kvbench", 1, 0, i, ns.torch_dtype)
        self.chunks, self.round = chunks, 0
        self.keys = []

    def put(self, i: int, chunk) -> None:
        obj = self.sm.allocate(self.size, self.dtype, fmt=self.fmt)
        if obj is None:
            raise RuntimeError("LMCache could not allocate host memory for a chunk")
        obj.tensor.copy_(chunk.view(self.shape))
        self.sm.batched_put([self.keys[i]], [obj])

    def settle(self) -> None:
        deadline = time.monotonic() + 120
        while not all(self.disk.contains(k) and not self.disk.exists_in_put_tasks(k) for k in self.keys):
            if time.monotonic() > deadline:
                raise RuntimeError("LMCache's disk writes did not finish within 120 s")
            time.sleep(0.005)

    def get(self, outs) -> None:
        for i, k in enumerate(self.keys):
            obj = self.sm.get(k)
            if obj is None:
                raise RuntimeError("LMCache lost a chunk")
            outs[i % len(outs)].view(self.shape).copy_(obj.tensor.view(self.shape))
            obj.ref_count_down()

    def drop_host(self) -> list[str]:
        self.sm.batched_remove(self.keys, locations=["LocalCPUBackend"])
        return [os.path.join(self.path, f) for f in os.listdir(self.path)]

    def reset(self) -> None:
        if self.keys:
            self.sm.batched_remove(self.keys)
        self.keys = [self._key(self.round * self.chunks + i) for i in range(self.chunks)]
        self.round += 1

    def close(self) -> None:
        self.sm.close()


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _put_ms(system, chunks) -> list[float]:
    """Every chunk put, one by one: each put's milliseconds, in order."""
    ms = []
    for i, chunk in enumerate(chunks):
        ms.append(_timed(lambda: system.put(i, chunk)) * 1e3)
    return ms


def _round(system, chunks, outs, total: int, pairs) -> dict:
    """One system's turn in a round, with the limits measured beside it on the same buffers
    and files (so a busy moment weighs on both alike)."""
    import torch

    system.reset()
    put_ms = _put_ms(system, chunks)
    system.settle()
    memcpy_before_get = memcpy_limit(pairs)  # and right after, and at the end: memory's speed drifts too
    host_s = best_time(lambda: system.get(outs))
    if not torch.equal(outs[(len(chunks) - 1) % len(outs)], chunks[-1]):
        raise RuntimeError(f"{system.name} returned wrong bytes from host RAM")
    memcpy_after_get = memcpy_limit(pairs)
    files = system.drop_host()
    # raw reads of the same files just before the cold get and just after it (the disk's
    # speed drifts over minutes); the ones before also read the files once, so a virtual
    # disk's own cache below the guest's favours neither
    disk_before = disk_read_limit(files)
    drop_cache(files)
    cold_s = _timed(lambda: system.get(outs))
    if not torch.equal(outs[(len(chunks) - 1) % len(outs)], chunks[-1]):
        raise RuntimeError(f"{system.name} returned wrong bytes from disk")
    return {"put": total / (sum(put_ms) / 1e3) / GB, "put_p50_ms": float(np.percentile(put_ms, 50)),
            "put_p99_ms": float(np.percentile(put_ms, 99)), "put_ms": put_ms,
            "host_get": total / host_s / GB, "cold_get": total / cold_s / GB,
            "memcpy": best_over([memcpy_before_get, memcpy_after_get, memcpy_limit(pairs)]),
            "disk_read": best_over([disk_before, disk_read_limit(files)])}


def _peer(name: str):
    if name == "none":
        return None
    try:
        import lmcache  # noqa: F401  (only to learn whether it is there)
    except ImportError:
        raise UsageError(INSTALL) from None
    return LMCachePeer


def run(args) -> int:
    if min(args.chunks, args.rounds, args.destinations) <= 0:
        raise UsageError("--chunks, --rounds and --destinations must be positive")
    peer_cls = _peer(args.peer)
    import torch  # here, not at the top: --help, a mistyped argument or a missing peer go without its seconds

    from kvstore.codecs.raw import tensor_bytes

    ns = Namespace("kvbench", args.layers, args.kv_heads, args.head_dim, "float16", args.tokens)
    chunks = [torch.randn(ns.chunk_shape).to(torch.float16) for _ in range(args.chunks)]
    outs = [torch.zeros_like(chunks[0]) for _ in range(args.destinations)]  # pre-touched
    chunk_bytes = chunks[0].numel() * 2
    total = args.chunks * chunk_bytes
    owned = args.dir is None
    root = args.dir or tempfile.mkdtemp(prefix="kvbench-peers-")
    systems = []
    try:
        systems.append(Ours(ns, args.chunks, chunk_bytes, root, args.direct_writes, args.read_form))
        ours_form = systems[0].read_form
        if peer_cls is not None:
            systems.append(peer_cls(ns, args.chunks, chunk_bytes, root, args.rounds))
        pairs = [(np.frombuffer(tensor_bytes(outs[i % len(outs)]), dtype=np.uint8),
                  np.frombuffer(tensor_bytes(c), dtype=np.uint8)) for i, c in enumerate(chunks)]
        rounds: dict[str, list[dict]] = {s.name: [] for s in systems}
        for r in range(args.rounds):
            turns = in_turns(r, *[lambda s=s: _round(s, chunks, outs, total, pairs) for s in systems])
            for system, result in zip(systems, turns):
                rounds[system.name].append(result)
    finally:
        for s in systems:
            s.close()
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    report = _report(rounds, [s.name for s in systems])
    report.update(chunk_bytes=chunk_bytes, chunks=args.chunks, destinations=args.destinations, ours_read_form=ours_form)
    _print(report, [s.name for s in systems])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


LIMIT_OF = {"put": "memcpy", "host_get": "memcpy", "cold_get": "disk_read"}


def _report(rounds: dict[str, list[dict]], names: list[str]) -> dict:
    """Each round's limits (the best of every measurement taken in it), each system's figures
    and ratios as spreads over the rounds, the over-limit flags, and every round."""
    count = len(rounds[names[0]])
    limits = {kind: [best_over([rounds[n][r][kind] for n in names]) for r in range(count)]
              for kind in ("memcpy", "disk_read")}
    figures = {n: {phase: Spread.of([r[phase] for r in rounds[n]]) for phase in (*PHASES, "put_p50_ms", "put_p99_ms")}
               for n in names}
    vs_limit, flags = {}, []
    for n in names:
        figures[n]["put_p99_vs_p50"] = ratio([r["put_p99_ms"] for r in rounds[n]], [r["put_p50_ms"] for r in rounds[n]])
        vs_limit[n] = {phase: ratio([r[phase] for r in rounds[n]], [limit.gbps for limit in limits[LIMIT_OF[phase]]])
                       for phase in PHASES}
        for phase in PHASES:  # a peer's figure above the limit proves the limit wrong as much as ours
            flags += over_limit(f"{n} {phase.replace('_', ' ')}", [r[phase] for r in rounds[n]], limits[LIMIT_OF[phase]])
    report = {
        "rounds": {n: [{k: v.as_dict() if isinstance(v, Limit) else v for k, v in r.items()} for r in per]
                   for n, per in rounds.items()},
        "round_limits": [{kind: limits[kind][r].as_dict() for kind in limits} for r in range(count)],
        "limits": {kind: limit_summary(per_round) for kind, per_round in limits.items()},
        "figures": {n: {k: s.as_dict() for k, s in f.items()} for n, f in figures.items()},
        "vs_limit": {n: {k: s.as_dict() for k, s in f.items()} for n, f in vs_limit.items()},
        "over_limit": flags,
    }
    if len(names) > 1:
        report["ours_vs_peer"] = {phase: ratio([r[phase] for r in rounds[names[0]]],
                                               [r[phase] for r in rounds[names[1]]]).as_dict() for phase in PHASES}
    return report


def _print(report: dict, names: list[str]) -> None:
    def spread(d: dict) -> str:
        return Spread.from_dict(d).format()

    print(f"{report['chunks']} chunks of {report['chunk_bytes'] / 2**20:.2f} MiB, {len(report['round_limits'])} rounds "
          f"of both systems and the limits in turns, gets into {report['destinations']} rotating destinations; ours reads "
          f"the disk {report['ours_read_form']}; GB/s, median (min-max) over the rounds; a ratio is the median of the "
          f"per-round ratios")
    width = 22
    head = f"{'phase':<10}" + "".join(f"{n:>{width}}" for n in names) + f"{'limit':>{width}}"
    if len(names) > 1:
        head += f"{'ours/peer':>{width}}"
    print(head + "  limit's configuration (best in most rounds)")
    figures = report["figures"]
    for phase in PHASES:
        limit = report["limits"][LIMIT_OF[phase]]
        line = f"{phase:<10}" + "".join(f"{spread(figures[n][phase]):>{width}}" for n in names)
        line += f"{spread(limit):>{width}}"
        if len(names) > 1:
            line += f"{spread(report['ours_vs_peer'][phase]):>{width}}"
        print(line + f"  {limit['config']}")
        if phase == "put":  # each put's latency, beside the throughput (ms)
            for label, key in (("put P50 ms", "put_p50_ms"), ("put P99 ms", "put_p99_ms"), ("P99/P50", "put_p99_vs_p50")):
                print(f"{label:<10}" + "".join(f"{spread(figures[n][key]):>{width}}" for n in names))
    print("limits: each round's is the best of every measurement taken in it (memcpy before and after each system's gets, "
          "raw reads before and after each cold get)")
    for n in names:
        v = report["vs_limit"][n]
        print(f"{n} / its round's limits: put {spread(v['put'])}x memcpy, host get {spread(v['host_get'])}x memcpy, "
              f"cold get {spread(v['cold_get'])}x raw read")
    for line in over_limit_lines(report["over_limit"]):
        print(line)
