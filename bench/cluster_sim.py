"""``kvbench cluster-sim``: the cluster model (bench/cluster_model.py) checked against a real
small cluster, then run from 1 to 128 GPUs as load grows.

``--validate FILE`` takes the JSON of ``kvbench cluster``: for each cluster size, the model
is fed the bandwidths that run measured for each tier alone (disk, PFS, Redis; per node, the
run's aggregate over N) and predicts the burst with every tier (ours): aggregate GB/s and
mean load time, beside what was measured, with the error. GPU compute is left out there, as
the run has none. The model has no CPU: a cluster size whose run says its conditions did not
hold (its cores were saturated) is flagged as not covered, its error not a test of the model.

The sweep: nodes (one GPU each) from ``--nodes``, Poisson load per GPU from ``--loads``,
prefixes of ``--prefix-chunks`` chunks reused with probability ``--reuse`` by routing that
ignores where prefixes are (a node's own prefix with probability 1/N), and, for the host-RAM
case, a sweep of ``--host-hits``. Bandwidths default to a datacenter profile (stated in
docs/cluster.md): change them with the flags. ``--plot`` draws the curves.
"""

from __future__ import annotations

import json
import math
import sys

from bench.cli import UsageError
from bench.cluster_model import ClusterSpec, Request, copy_requests, simulate, summary, workload
from kvstore.config import parse_size

SYSTEMS = ("ours", "local_only")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("cluster-sim", help="a cluster model: checked against kvbench cluster, then 1-128 GPUs")
    p.add_argument("--validate", help="a kvbench cluster --json file to check the model against")
    p.add_argument("--nodes", default="1,2,4,8,16,32,64,128", help="cluster sizes (one GPU a node)")
    p.add_argument("--loads", default="0.05,0.1,0.2,0.4,0.6,0.8", help="requests/s per GPU (Poisson)")
    p.add_argument("--requests", type=int, default=2000, help="requests per point, over all nodes (10 a node at least)")
    p.add_argument("--prefix-chunks", default="8,64", help="prefix length in chunks: min,max (uniform)")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens after the prefix, always computed")
    p.add_argument("--reuse", type=float, default=0.8, help="probability a request reuses a stored prefix")
    p.add_argument("--host-hits", default="0,0.25,0.5,0.75,1", help="host-RAM hit probabilities to sweep")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--kv-bytes-per-token", default="128KiB", help="Llama-3-8B in fp16: 128 KiB")
    p.add_argument("--prefill-tokens-per-s", type=float, default=12000.0)
    p.add_argument("--disk", default="3GB/s", help="a node's local NVMe")
    p.add_argument("--pfs-link", default="12.5GB/s", help="a node's link to the PFS")
    p.add_argument("--pfs-aggregate", default="200GB/s", help="the PFS as a whole")
    p.add_argument("--redis-link", default="2.5GB/s", help="a node's share of Redis")
    p.add_argument("--redis-aggregate", default="40GB/s", help="the Redis Cluster as a whole")
    p.add_argument("--window", type=int, default=3,
                   help="a node's tiers serve the N earliest requests in turn (0: all; the daemon: io_threads / "
                        "get_read_ahead, rounded up)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--plot", help="write the curves here (PNG; needs matplotlib, the plot extra)")
    p.add_argument("--json", help="write the results as JSON here")
    p.set_defaults(func=run)


def _rate(text: str) -> float:
    return float(parse_size(text.removesuffix("/s")))


def _floats(text: str, name: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{name} takes numbers separated by commas, got {text!r}") from None


def _prefix_range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise UsageError(f"--prefix-chunks takes min,max, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise UsageError(f"--prefix-chunks needs 1 <= min <= max, got {text!r}")
    return lo, hi


# -- validation against kvbench cluster ------------------------------------------------------------


def validate(report: dict, window: int = 3) -> dict:
    """Per cluster size: the model fed the single-tier bandwidths the run measured (its
    tiers serving the ``window`` earliest requests in turn), its prediction of the burst
    with every tier, and the error against the measurement."""
    chunk_bytes = report["chunk_bytes"]
    prefixes, chunks = report["prefixes_per_node"], report["prefix_chunks"]
    out = {}
    for n_text, measured in report["nodes"].items():
        n = int(n_text)
        single = measured["single_gbps"]
        spec = ClusterSpec(nodes=n, chunk_bytes=chunk_bytes, chunk_tokens=1, prefill_tokens_per_s=math.inf,
                           disk_bps=single.get("disk", measured["local_only_gbps"]) * 1e9 / n,
                           pfs_link_bps=single["pfs"] * 1e9 / n, pfs_aggregate_bps=0,
                           redis_link_bps=single["redis"] * 1e9 / n, redis_aggregate_bps=0, window=window)
        burst = [Request(0.0, node, chunks, 0, (node + 1) % n) for node in range(n) for _ in range(prefixes)]
        ours = summary(simulate(spec, copy_requests(burst), "ours"))
        own = [Request(0.0, node, chunks, 0, node) for node in range(n) for _ in range(prefixes)]
        local = summary(simulate(spec, own, "local_only"))
        total = n * prefixes * chunks * chunk_bytes
        predicted = {"ours_gbps": total / ours["makespan_s"] / 1e9, "ours_ttft_mean_s": ours["ttft_mean_s"],
                     "local_only_own_ttft_mean_s": local["ttft_mean_s"]}
        real = {"ours_gbps": measured["ours_gbps"], "ours_ttft_mean_s": measured["burst_ttft_mean_s"]["ours"],
                "local_only_own_ttft_mean_s": measured["burst_ttft_mean_s"]["local_only_own_prefixes"]}
        out[n_text] = {"predicted": predicted, "measured": real,
                       "error": {k: predicted[k] / real[k] - 1 for k in predicted}, **_coverage(measured)}
    return out


def _coverage(measured: dict) -> dict:
    """Whether the run's conditions are ones the model describes (tiers, not cores, the limit)."""
    conditions = measured.get("conditions")
    if conditions is None:
        return {"covered": None, "why": "the run predates CPU measurement: its conditions are unknown"}
    return {"covered": conditions["hold"], "why": conditions["why"]}


# -- the sweep -------------------------------------------------------------------------------------------


def _spec(args, nodes: int) -> ClusterSpec:
    return ClusterSpec(nodes=nodes, chunk_bytes=args.chunk_tokens * parse_size(args.kv_bytes_per_token),
                       chunk_tokens=args.chunk_tokens, prefill_tokens_per_s=args.prefill_tokens_per_s,
                       disk_bps=_rate(args.disk), pfs_link_bps=_rate(args.pfs_link),
                       pfs_aggregate_bps=_rate(args.pfs_aggregate), redis_link_bps=_rate(args.redis_link),
                       redis_aggregate_bps=_rate(args.redis_aggregate), window=args.window)


def _point(args, nodes: int, load: float, host_hit: float) -> dict:
    spec = _spec(args, nodes)
    lo, hi = _prefix_range(args.prefix_chunks)
    per_node = max(10, args.requests // nodes)
    requests = workload(spec, per_node, load, (lo, hi), args.new_tokens, args.reuse, None, host_hit, args.seed)
    result = {s: summary(simulate(spec, copy_requests(requests), s)) for s in SYSTEMS}
    result["ttft_gain"] = result["local_only"]["ttft_mean_s"] / result["ours"]["ttft_mean_s"]
    return result


def sweep(args) -> dict:
    nodes = [int(x) for x in _floats(args.nodes, "nodes")]
    loads = _floats(args.loads, "loads")
    if not nodes or min(nodes) < 1 or not loads or min(loads) < 0:
        raise UsageError("--nodes must be positive and --loads not negative")
    _prefix_range(args.prefix_chunks)
    curves = {str(n): {str(load): _point(args, n, load, 0.0) for load in loads} for n in nodes}
    offline = {str(n): _point(args, n, 0.0, 0.0) for n in nodes}  # everything at once: throughput
    big = max(nodes)
    busiest = max(loads)
    host = {str(h): _point(args, big, busiest, h) for h in _floats(args.host_hits, "host-hits")}
    return {"curves": curves, "offline": offline, "host_hit_at": {"nodes": big, "load": busiest, "points": host}}


def gain_appears(curves: dict, nodes: str, threshold: float = 1.1) -> float | None:
    """The lowest load at which ours' mean TTFT is ``threshold`` times lower than local-only's."""
    for load, point in sorted(curves[nodes].items(), key=lambda kv: float(kv[0])):
        if point["ttft_gain"] >= threshold:
            return float(load)
    return None


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = result["curves"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for n in curves:
        if n not in ("1", "8", "128") and n != max(curves, key=int):
            continue
        loads = sorted(curves[n], key=float)
        for system, style in (("ours", "-"), ("local_only", "--")):
            axes[0].plot([float(x) for x in loads], [curves[n][x][system]["ttft_mean_s"] for x in loads], style,
                         marker="o", label=f"{system}, {n} GPUs")
    axes[0].set(xlabel="load (requests/s per GPU)", ylabel="mean TTFT (s)", yscale="log", title="mean TTFT")
    axes[0].legend(fontsize=7)
    for load in sorted(next(iter(curves.values())), key=float):
        ns = sorted(curves, key=int)
        axes[1].plot([int(n) for n in ns], [curves[n][load]["ttft_gain"] for n in ns], marker="o", label=f"{load}/s")
    axes[1].set(xlabel="GPUs (one a node)", ylabel="local-only / ours, mean TTFT", xscale="log",
                title="TTFT gain by cluster size and load")
    axes[1].axhline(1.0, color="grey", linewidth=0.8)
    axes[1].legend(fontsize=7, title="load per GPU")
    host = result["host_hit_at"]["points"]
    hs = sorted(host, key=float)
    axes[2].plot([float(h) for h in hs], [host[h]["ttft_gain"] for h in hs], marker="o")
    axes[2].axhline(1.0, color="grey", linewidth=0.8)
    axes[2].set(xlabel="share of reused prefixes already in the node's host RAM", ylabel="local-only / ours, mean TTFT",
                title=f"{result['host_hit_at']['nodes']} GPUs at {result['host_hit_at']['load']}/s per GPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args) -> int:
    if args.window < 0:
        raise UsageError("--window must be 0 (all) or positive")
    report: dict = {}
    if args.validate:
        try:
            with open(args.validate) as f:
                measured = json.load(f)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--validate: cannot read {args.validate}: {exc}") from None
        report["validation"] = validate(measured, args.window)
        for n, v in report["validation"].items():
            p, m, e = v["predicted"], v["measured"], v["error"]
            print(f"N={n}: ours GB/s predicted {p['ours_gbps']:.3f}, measured {m['ours_gbps']:.3f} ({e['ours_gbps']:+.0%}); "
                  f"mean load s {p['ours_ttft_mean_s']:.3f} vs {m['ours_ttft_mean_s']:.3f} ({e['ours_ttft_mean_s']:+.0%}); "
                  f"local-only own {p['local_only_own_ttft_mean_s']:.3f} vs {m['local_only_own_ttft_mean_s']:.3f} "
                  f"({e['local_only_own_ttft_mean_s']:+.0%})")
            if v["covered"] is not True:
                print(f"     NOT COVERED by the model at N={n}: {v['why']}")
    report["sweep"] = result = sweep(args)
    print("mean TTFT s, ours / local-only (gain), by load per GPU:")
    for n, points in result["curves"].items():
        cells = "  ".join(f"{load}: {p['ours']['ttft_mean_s']:.3f}/{p['local_only']['ttft_mean_s']:.3f} ({p['ttft_gain']:.2f}x)"
                          for load, p in points.items())
        appears = gain_appears(result["curves"], n)
        print(f"  {n:>3} GPUs  {cells}  gain >= 1.1x from {appears if appears is not None else 'no load tried'}")
    print("offline throughput, requests/s, ours / local-only: " + "  ".join(
        f"{n}: {p['ours']['requests_per_s']:.1f}/{p['local_only']['requests_per_s']:.1f}" for n, p in result["offline"].items()))
    h = result["host_hit_at"]
    print(f"host-RAM hits at {h['nodes']} GPUs, {h['load']}/s per GPU, gain: " + "  ".join(
        f"{hit}: {p['ttft_gain']:.2f}x" for hit, p in h["points"].items()))
    if args.plot:
        plot(result, args.plot)
        print(f"curves: {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    sys.stdout.flush()
    return 0
