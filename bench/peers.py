"""``kvbench peers``: our Store and LMCache's in-process StorageManager (LocalCPUBackend +
LocalDiskBackend) on exactly the same work, in the same process and run, beside the limits.

The work (defaults: 24 chunks of 32 MiB, fp16, 256 tokens x 32 layers x 8 KV heads x 128):
put every chunk (a put returns once the chunk is in host RAM; the disk copy is written
behind and waited for outside the timing; each put is timed too, for its median and P99
beside the throughput; our Store runs write-behind's defaults, as users do); get them from host RAM into 4 rotating,
pre-touched destination tensors; drop the host copies and the page cache of the disk copies
(checked dropped), then read them cold from disk into the same destinations. Rounds
alternate which system goes first. Limits (bench/limits.py) are measured after each round on
the same buffers and files; the table's limit is the best of them.

LMCache is optional and never a dependency: ``pip install lmcache==0.5.6`` beside CPU torch
(docs/benchmarks.md says how). ``--peer none`` runs ours and the limits alone.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from bench.cli import UsageError
from bench.limits import best_over, disk_read_limit, drop_cache, memcpy_limit, over_limit
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
    p.add_argument("--rounds", type=int, default=3)
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
    """One round of the work, with the limits measured right after it on the same buffers
    and files (so a busy moment weighs on both alike)."""
    import torch

    system.reset()
    put_ms = _put_ms(system, chunks)
    system.settle()
    host_s = _timed(lambda: system.get(outs))
    if not torch.equal(outs[(len(chunks) - 1) % len(outs)], chunks[-1]):
        raise RuntimeError(f"{system.name} returned wrong bytes from host RAM")
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
            "memcpy": memcpy_limit(pairs), "disk_read": best_over([disk_before, disk_read_limit(files)])}


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
            for system in systems if r % 2 == 0 else systems[::-1]:
                rounds[system.name].append(_round(system, chunks, outs, total, pairs))
    finally:
        for s in systems:
            s.close()
        if owned:
            shutil.rmtree(root, ignore_errors=True)
    limits = [(r["memcpy"], r["disk_read"]) for per_round in rounds.values() for r in per_round]
    memcpy = max((m for m, _ in limits), key=lambda limit: limit.gbps)
    disk = max((d for _, d in limits), key=lambda limit: limit.gbps)
    for per_round in rounds.values():
        for r in per_round:
            r["memcpy"], r["disk_read"] = r["memcpy"].as_dict(), r["disk_read"].as_dict()
    report = {"chunk_bytes": chunk_bytes, "chunks": args.chunks, "destinations": args.destinations,
              "ours_read_form": ours_form, "rounds": rounds, "limits": {"memcpy": memcpy.as_dict(), "disk_read": disk.as_dict()}}
    ours = rounds[systems[0].name]
    report["over_limit"] = (over_limit({"put": max(r["put"] for r in ours), "host get": max(r["host_get"] for r in ours)}, memcpy)
                            + over_limit({"cold get": max(r["cold_get"] for r in ours)}, disk))
    _print(report, [s.name for s in systems], memcpy, disk)
    for w in report["over_limit"]:
        print(f"warning: {w}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


def _print(report: dict, names: list[str], memcpy, disk) -> None:
    print(f"{report['chunks']} chunks of {report['chunk_bytes'] / 2**20:.2f} MiB, {len(report['rounds'][names[0]])} rounds, "
          f"gets into {report['destinations']} rotating destinations; ours reads the disk "
          f"{report['ours_read_form']}; GB/s, min-max over rounds")
    limit_of = {"put": memcpy, "host_get": memcpy, "cold_get": disk}
    head = f"{'phase':<10}" + "".join(f"{n:>22}" for n in names) + f"{'limit':>10}"
    if len(names) > 1:
        head += f"{'ours/peer':>12}"
    print(head + "  limit's configuration")
    for phase in PHASES:
        figures = [[r[phase] for r in report["rounds"][n]] for n in names]
        line = f"{phase:<10}" + "".join(f"{_span(f):>22}" for f in figures) + f"{limit_of[phase].gbps:10.2f}"
        if len(names) > 1:
            ratios = [a / b for a, b in zip(*figures[:2])]
            line += f"{_span(ratios):>12}"
        print(line + f"  {limit_of[phase].config}")
        if phase == "put":  # each put's latency, beside the throughput (ms, min-max over rounds)
            for label, of in (("put P50 ms", lambda r: r["put_p50_ms"]), ("put P99 ms", lambda r: r["put_p99_ms"]),
                              ("P99/P50", lambda r: r["put_p99_ms"] / r["put_p50_ms"])):
                print(f"{label:<10}" + "".join(f"{_span([of(r) for r in report['rounds'][n]]):>22}" for n in names))
    print("limits: the best over every round's measurement, each taken right after that round")
    for name in names:
        per = report["rounds"][name]
        print(f"{name} / its round's limits: put {_span([r['put'] / r['memcpy']['gbps'] for r in per])}x memcpy, "
              f"host get {_span([r['host_get'] / r['memcpy']['gbps'] for r in per])}x memcpy, cold get "
              f"{_span([r['cold_get'] / r['disk_read']['gbps'] for r in per])}x raw read")
