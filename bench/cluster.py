"""``kvbench cluster``: a real small cluster on this machine, N daemons (``kvstore serve``
processes), each with its own host RAM and private disk directory, sharing one PFS
directory and a 3-primary Redis Cluster (started here from Debian's ``redis-server``), as
members of one cluster (docs/cluster.md), each with a client workload process of its own.

For each N: every node's client puts its own prefixes (durable: on its disk, the PFS and
Redis). Then every node's client sends a burst: all its requests at once, each one prefix
(lookup, then get of every chunk), of prefixes that ANOTHER node wrote (node i reads node
i+1's; with N = 1, its own). The burst runs against the daemons restarted (empty host RAM,
no promotion) in one configuration at a time:

- ``pfs`` and ``redis``: that shared tier alone (host RAM and that tier; and ``disk`` alone
  where N = 1, the only case where the local disk holds the prefixes: ``local_only``); the
  sum of these is the reachable tiers' bandwidth, measured alone in the same run;
- ``ours``: every tier, free-tier fetching over every replica;
- ``local_only`` (LMCache-like: node-local disk only, no shared tiers): another node's
  prefix is a miss, to be recomputed; its burst TTFT is MODELED as sequential prefill at
  ``--prefill-tokens-per-s``. Its bandwidth is measured on the node's OWN prefixes from its
  own disk (the best a node-local cache can do), and so is ``local_only_own_ttft``.

Network emulation: every tier of every daemon is capped (``--emulate``, tiers/throttle.py),
as one node's link to that medium; the PFS and Redis have no aggregate cap. Aggregate read
GB/s = bytes every node read / the burst's makespan (first request sent to last chunk
in, over all nodes); TTFT here is the load part only (no model runs): the time from the
burst to a request's last chunk. The best of ``--rounds`` bursts is kept.

The caps are meant to be the bottleneck. N daemons, N clients and three Redis servers share
this machine's cores, so each burst also measures how busy the cores were (bench/cpu_busy.py):
where they were saturated during a kept burst, the run says its conditions do not hold for
that N (the figure then measures the CPU, not free-tier fetching) and ``kvbench cluster-sim
--validate`` does not compare its model with it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.cli import UsageError
from bench.cpu_busy import SATURATED, CpuMeter
from bench.redis_local import REDIS_CLI, REDIS_SERVER, start_cluster
from kvstore.config import parse_size

GB = 1e9
VARIANTS = ("pfs", "redis", "ours", "local_only")  # local_only with N = 1 is the disk alone


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cluster", help="N daemons sharing a PFS directory and a Redis Cluster, vs node-local only")
    p.add_argument("--nodes", default="1,2", help="cluster sizes to run, e.g. 1,2,4")
    p.add_argument("--prefixes", type=int, default=8, help="requests per node in a burst (one prefix each)")
    p.add_argument("--prefix-chunks", type=int, default=16, help="chunks per prefix")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tokens", type=int, default=256, help="tokens per chunk")
    p.add_argument("--emulate", default="disk=100MB/s,pfs=100MB/s,redis=100MB/s",
                   help="per-daemon read caps of the tiers (one node's link to each)")
    p.add_argument("--rounds", type=int, default=2, help="bursts per configuration; the best is kept")
    p.add_argument("--prefill-tokens-per-s", type=float, default=20000.0,
                   help="local-only recomputes another node's prefix at this rate (modeled)")
    p.add_argument("--dir", help="working directory (default: a temporary one, removed)")
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=run)


def _caps(text: str) -> dict[str, int]:
    caps = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in ("disk", "pfs", "redis") or not value:
            raise UsageError(f"--emulate takes disk=RATE,pfs=RATE,redis=RATE, got {part!r}")
        caps[name] = parse_size(value)
        if caps[name] <= 0:
            raise UsageError("--emulate caps must be positive")
    if set(caps) != {"disk", "pfs", "redis"}:
        raise UsageError("--emulate must cap disk, pfs and redis (one serialised device each)")
    return caps


def run(args) -> int:
    try:
        nodes = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        raise UsageError(f"--nodes takes sizes like 1,2,4, got {args.nodes!r}") from None
    if not nodes or min(nodes) < 1 or min(args.prefixes, args.prefix_chunks, args.rounds) < 1:
        raise UsageError("--nodes, --prefixes, --prefix-chunks and --rounds must be positive")
    if REDIS_SERVER is None or REDIS_CLI is None:
        raise UsageError("redis-server and redis-cli are needed (Debian: apt-get install redis-server)")
    caps = _caps(args.emulate)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvbench-cluster-"))
    servers = start_cluster(root / "redis", nodes=3)
    try:
        report = {"nodes": {}, "emulated_caps_bytes_per_s": caps, "prefixes_per_node": args.prefixes,
                  "prefix_chunks": args.prefix_chunks, "rounds": args.rounds}
        for n in nodes:
            for s in servers:
                s.cli("FLUSHALL")
            report["nodes"][str(n)] = _measure(args, root / f"n{n}", servers[0].url, n, caps)
            _print_one(n, report["nodes"][str(n)])
            report["chunk_bytes"] = report["nodes"][str(n)].pop("chunk_bytes")
    finally:
        for s in servers:
            s.stop()
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


# -- the daemons ------------------------------------------------------------------------------------


def _toml(root: Path, node: int, variant: str, redis_url: str, caps: dict[str, int], budget: int) -> str:
    """One node's daemon configuration for one variant (the write phase uses ``ours``)."""
    pfs = variant in ("pfs", "ours")
    redis = variant in ("redis", "ours")
    shared = pfs or redis
    text = f"""
listen = "127.0.0.1:0"
[shm]
slots = 16
slot_bytes = "2MiB"
[store]
promote_on_read = false
[store.host]
capacity_bytes = "64MiB"
prefault = false
[store.disk]
enabled = {'false' if variant in ('pfs', 'redis') else 'true'}
path = "{root / f'node{node}' / 'disk'}"
capacity_bytes = {budget}
read_bytes_per_s = {caps['disk']}
fetch_workers = 2
[store.write_behind]
max_pending_bytes = "16MiB"
"""
    if pfs:
        text += f"""[store.pfs]
enabled = true
path = "{root / 'pfs'}"
capacity_bytes = {budget}
read_bytes_per_s = {caps['pfs']}
fetch_workers = 2
"""
    if redis:
        text += f"""[store.redis]
enabled = true
cluster = true
url = "{redis_url}"
key_prefix = "kvbench:v:"
capacity_bytes = {budget}
read_bytes_per_s = {caps['redis']}
fetch_workers = 2
"""
    if shared:
        text += f"""[store.shared_index]
enabled = true
cluster = true
url = "{redis_url}"
key_prefix = "kvbench:i:"
[store.cluster]
enabled = true
member = "node{node}"
"""
    path = root / f"node{node}.{variant}.toml"
    path.write_text(text)
    return str(path)


class _Daemons:
    """N daemons in one variant's configuration, started together, stopped cleanly."""

    def __init__(self, root: Path, n: int, variant: str, redis_url: str, caps: dict[str, int], budget: int) -> None:
        from kvstore.daemon.spawn import DaemonProcess

        self.procs = []
        try:
            for i in range(n):
                self.procs.append(DaemonProcess(["--config", _toml(root, i, variant, redis_url, caps, budget)],
                                                env={"OMP_NUM_THREADS": "1"}))
        except BaseException:
            self.stop()
            raise

    @property
    def addrs(self) -> list[str]:
        return [p.addr for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            p.stop()


# -- the client workload processes ------------------------------------------------------------------


def _namespace(args):
    from kvstore.keys import Namespace

    return Namespace("kvbench-cluster", args["layers"], args["kv_heads"], args["head_dim"], "float16", args["tokens"])


def _prefix_keys(args, writer: int, j: int):
    """Prefix ``j`` of node ``writer``: its own tokens, so no two nodes share a chunk."""
    from kvstore.keys import chunk_keys

    base = (writer * args["prefixes"] + j) * args["prefix_chunks"] * args["tokens"] * 7
    return chunk_keys(list(range(base, base + args["prefix_chunks"] * args["tokens"])), _namespace(args))


def _worker(node: int, args: dict, conn, barrier) -> None:
    """One node's client: runs the commands it is sent (put, burst) against its daemon. A
    Ctrl-C in a terminal reaches it too: it leaves the ending to the parent (``kvbench``),
    which ends it and alone says so."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from kvstore.client import Client

    torch.set_num_threads(1)
    while (command := conn.recv()) is not None:
        kind, addr, writer = command
        if kind == "put":
            chunk = torch.randn(_namespace(args).chunk_shape).half()
            with Client(addr) as client:
                for j in range(args["prefixes"]):
                    for key in _prefix_keys(args, writer, j):
                        client.put(key, chunk, durable=True)
            conn.send(None)
        else:
            conn.send(_burst(args, addr, writer, barrier))


def _burst(args: dict, addr: str, writer: int, barrier) -> dict:
    """Every request of this node at once, one thread and client each; when each ended."""
    from kvstore.client import Client

    prefixes = [_prefix_keys(args, writer, j) for j in range(args["prefixes"])]
    clients = [Client(addr) for _ in prefixes]
    done = [0.0] * len(prefixes)
    got = [0] * len(prefixes)
    go = threading.Event()

    def request(i: int) -> None:
        go.wait()
        n = clients[i].lookup(prefixes[i])
        got[i] = len(clients[i].get(prefixes[i][:n]))
        done[i] = time.time()

    threads = [threading.Thread(target=request, args=(i,)) for i in range(len(prefixes))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.time()
    go.set()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return {"start": start, "done": done, "chunks": got}


class _Workers:
    def __init__(self, n: int, args: dict) -> None:
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(n)
        self.conns, self.procs = [], []
        for i in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(i, args, child, self.barrier), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def all(self, kind: str, addrs: list[str], writers: list[int]) -> list:
        for conn, addr, writer in zip(self.conns, addrs, writers):
            conn.send((kind, addr, writer))
        return [conn.recv() for conn in self.conns]

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(30)


# -- one cluster size ---------------------------------------------------------------------------------


def _measure(args, root: Path, redis_url: str, n: int, caps: dict[str, int]) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    work = {k: getattr(args, k) for k in ("layers", "kv_heads", "head_dim", "tokens", "prefixes", "prefix_chunks")}
    chunk_bytes = _namespace(work).chunk_bytes
    per_node = args.prefixes * args.prefix_chunks * chunk_bytes
    budget = 2 * n * per_node + (64 << 20)  # room for everything: this run measures reads, not evictions
    workers = _Workers(n, work)
    try:
        daemons = _Daemons(root, n, "ours", redis_url, caps, budget)
        try:
            workers.all("put", daemons.addrs, list(range(n)))
        finally:
            daemons.stop()
        others = [(i + 1) % n for i in range(n)]
        results = {}
        with CpuMeter() as meter:
            for variant in VARIANTS:
                writers = list(range(n)) if variant == "local_only" else others
                daemons = _Daemons(root, n, variant, redis_url, caps, budget)
                try:
                    bursts = [_summary(workers.all("burst", daemons.addrs, writers), chunk_bytes,
                                       args.prefix_chunks, meter) for _ in range(args.rounds)]
                finally:
                    daemons.stop()
                results[variant] = min(bursts, key=lambda b: b["makespan_s"])
    finally:
        workers.close()
    # where N = 1 the disk holds the prefixes too; else only the shared tiers are reachable
    single = {**({"disk": results["local_only"]["gbps"]} if n == 1 else {}),
              "pfs": results["pfs"]["gbps"], "redis": results["redis"]["gbps"]}
    prefix_tokens = args.prefix_chunks * args.tokens
    modeled = sum((k + 1) * prefix_tokens / args.prefill_tokens_per_s for k in range(args.prefixes)) / args.prefixes
    return {
        "chunk_bytes": chunk_bytes,
        "ours_gbps": results["ours"]["gbps"],
        "local_only_gbps": results["local_only"]["gbps"],
        "sum_of_tiers_gbps": sum(single.values()),
        "single_gbps": single,
        "ours_over_sum": results["ours"]["gbps"] / sum(single.values()),
        "burst_ttft_mean_s": {"ours": results["ours"]["ttft_mean_s"], "local_only": modeled,
                              "local_only_own_prefixes": results["local_only"]["ttft_mean_s"]},
        "local_only_ttft_is_modeled": True,
        "conditions": _conditions(results),
        "bursts": results,
    }


def _conditions(results: dict) -> dict:
    """Whether the caps, not the cores, limited every kept burst."""
    saturated = {v: r["cpu"]["machine_busy"] for v, r in results.items() if r["cpu"] and r["cpu"]["saturated"]}
    unknown = [v for v, r in results.items() if not r["cpu"]]
    if saturated:
        worst = max(saturated, key=saturated.get)
        return {"hold": False, "why": f"CPU-bound: the cores were {saturated[worst]:.0%} busy during the "
                f"{worst!r} burst (saturated at {SATURATED:.0%}; {', '.join(saturated)}), so the caps did not "
                "limit it"}
    if unknown:
        return {"hold": None, "why": f"CPU use not measured (no /proc) for {', '.join(unknown)}"}
    return {"hold": True, "why": f"the cores stayed under {SATURATED:.0%} busy in every kept burst"}


def _summary(replies: list[dict], chunk_bytes: int, prefix_chunks: int, meter: CpuMeter) -> dict:
    start = min(r["start"] for r in replies)
    ends = [d for r in replies for d in r["done"]]
    chunks = sum(sum(r["chunks"]) for r in replies)
    if chunks != sum(len(r["chunks"]) for r in replies) * prefix_chunks:
        raise RuntimeError(f"a burst found {chunks} of {sum(len(r['chunks']) for r in replies) * prefix_chunks} chunks")
    makespan = max(ends) - start
    cpu = meter.use(start, max(ends))
    if cpu is not None:  # what reading costs this machine: core-seconds of this run's processes per GB read
        cpu = {**cpu.as_dict(), "core_s_per_gb": round(cpu.ours * cpu.cores * makespan / (chunks * chunk_bytes / GB), 3)}
    return {"makespan_s": makespan, "gbps": chunks * chunk_bytes / makespan / GB, "cpu": cpu,
            "ttft_mean_s": sum(d - r["start"] for r in replies for d in r["done"]) / len(ends)}


def _print_one(n: int, r: dict) -> None:
    single = ", ".join(f"{t} {g:.3f}" for t, g in r["single_gbps"].items())
    t = r["burst_ttft_mean_s"]
    print(f"N={n}: ours {r['ours_gbps']:.3f} GB/s = {r['ours_over_sum']:.2f} x the sum of the reachable tiers alone "
          f"({single}: {r['sum_of_tiers_gbps']:.3f}); local-only (own prefixes, own disk) {r['local_only_gbps']:.3f} GB/s")
    print(f"     burst TTFT mean (load part): ours {t['ours']:.3f} s; local-only {t['local_only']:.3f} s (modeled "
          f"recompute of another node's prefixes), {t['local_only_own_prefixes']:.3f} s on its own prefixes")
    cpu = r["bursts"]["ours"]["cpu"]
    if cpu:
        print(f"     cores busy during ours: {cpu['machine_busy']:.0%} of {cpu['cores']} "
              f"(this run {cpu['ours']:.0%}, other work {cpu['others']:.0%}); this run's processes spent "
              f"{cpu['core_s_per_gb']:.2f} core-s per GB read")
    if r["conditions"]["hold"] is not True:
        print(f"     CONDITIONS DO NOT HOLD at N={n}: {r['conditions']['why']}; the figures above are not a "
              "measure of free-tier fetching")
    sys.stdout.flush()
