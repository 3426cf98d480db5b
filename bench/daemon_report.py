"""``kvbench daemon``'s report: the rounds' medians and spreads, the ratios to the machine's
limits, the rounds in which a path beat its limit, and the table printed."""

from __future__ import annotations

from bench.daemon_paths import PathBench
from bench.limits import Limit
from bench.rounds import Spread, limit_summary, over_limit, over_limit_lines, ratio


def make_report(rounds: list[dict], paths: dict[str, PathBench], chunk_bytes: int, args) -> dict:
    """Medians under the keys a single run used to have, each section's spreads, the per-round
    ratios' medians, the over-limit flags, and every round (its limits as dicts)."""
    def of(*where) -> list:
        values = []
        for r in rounds:
            for key in where:
                r = r[key]
            values.append(r)
        return values

    sock, copy = of("socket_limit"), of("memcpy_limit")
    report = {"chunk_bytes": chunk_bytes, "clients": args.clients, "seconds": args.seconds, "tenants": args.addr is None}
    for name, path in paths.items():
        spreads = {key: Spread.of(of(name, key)) for key in rounds[0][name]}
        report[name] = {"transport": path.used, "get_batch": path.batch,
                        **{key: s.median for key, s in spreads.items()},
                        "spread": {key: s.as_dict() for key, s in spreads.items()}}
    limits = {"socket": (sock, "socket_cpu_s_per_gb"), "memcpy": (copy, "memcpy_cpu_s_per_gb")}
    for name, (limit, cpu) in limits.items():
        report[f"{name}_gbps"] = limit_summary(limit)["gbps"]
        report[f"{name}_limit"] = limit_summary(limit)
        report[cpu] = Spread.of(of(cpu)).median
    figures = {"remote_get_vs_socket": ("remote", "get_gbps", sock), "remote_put_vs_socket": ("remote", "put_gbps", sock),
               "shm_get_vs_memcpy": ("shm", "get_gbps", copy), "shm_put_vs_memcpy": ("shm", "put_gbps", copy)}
    spreads = {name: ratio(of(path, key), [limit.gbps for limit in limit_of]) for name, (path, key, limit_of) in figures.items()}
    report["ratios"] = {name: s.median for name, s in spreads.items()}
    report["ratios_spread"] = {name: s.as_dict() for name, s in spreads.items()}
    if args.processes:
        report["aggregate"] = {}
        for name in paths:
            per_round = of(f"aggregate_{name}", "get_gbps")
            report["aggregate"][name] = {
                "processes": rounds[0][f"aggregate_{name}"]["processes"], "get_gbps": Spread.of(per_round).median,
                "vs_one_client": ratio(per_round, of(name, "get_gbps")).median,
                "spread": {"get_gbps": Spread.of(per_round).as_dict(),
                           "vs_one_client": ratio(per_round, of(name, "get_gbps")).as_dict()}}
    flags = []
    for name, limit in (("remote", sock), ("shm", copy)):
        for op in ("put", "get", "get_one"):
            flags += over_limit(f"{name} {op.replace('_one', ' x1')}", of(name, f"{op}_gbps"), limit)
        if args.processes:
            flags += over_limit(f"{name} {args.processes} processes' get", of(f"aggregate_{name}", "get_gbps"), limit)
    report["over_limit"] = flags
    report["rounds"] = [{k: v.as_dict() if isinstance(v, Limit) else v for k, v in r.items()} for r in rounds]
    return report


def print_report(report: dict, args) -> None:
    def spread(section: dict, key: str, scale: float = 1.0, digits: int = 2) -> str:
        s = Spread.from_dict(section["spread"][key])
        return Spread(s.median * scale, s.min * scale, s.max * scale).format(digits)

    print(f"chunk {report['chunk_bytes']} B, {args.clients} client(s), {args.seconds:g} s per figure, {args.rounds} "
          f"rounds of the paths and the limits in turns: median (min-max) over the rounds; a ratio is the median of "
          f"the per-round ratios")
    for name in ("remote", "shm"):
        r = report[name]
        label = f"{name} ({r['transport']})"
        for op, what in (("put", "put"), ("get", f"get x{r['get_batch']}"), ("get_one", "get x1")):
            print(f"{label:14} {what:7} {spread(r, f'{op}_gbps')} GB/s, P50 {spread(r, f'{op}_p50_s', 1e3)} ms, "
                  f"P99 {spread(r, f'{op}_p99_s', 1e3)} ms; CPU s/GB client + daemon "
                  f"{r[f'{op}_client_cpu_s_per_gb']:.2f} + {r[f'{op}_daemon_cpu_s_per_gb']:.2f}")
            label = ""
    sock, copy = report["socket_limit"], report["memcpy_limit"]
    print(f"limits: raw loopback socket {Spread.from_dict(sock).format()} GB/s ({sock['config']} in most rounds; "
          f"{report['socket_cpu_s_per_gb']:.2f} CPU s/GB), memcpy {Spread.from_dict(copy).format()} GB/s "
          f"({copy['config']} in most rounds; {report['memcpy_cpu_s_per_gb']:.2f} CPU s/GB); each round's best "
          f"configuration")
    for name, agg in report.get("aggregate", {}).items():
        print(f"{name:6} {agg['processes']} processes at once: get {spread(agg, 'get_gbps')} GB/s in all = "
              f"{spread(agg, 'vs_one_client')}x one client's")
    q = report["ratios_spread"]
    print(f"remote get {Spread.from_dict(q['remote_get_vs_socket']).format()}x socket, put "
          f"{Spread.from_dict(q['remote_put_vs_socket']).format()}x; shm get "
          f"{Spread.from_dict(q['shm_get_vs_memcpy']).format()}x memcpy, put {Spread.from_dict(q['shm_put_vs_memcpy']).format()}x")
    for line in over_limit_lines(report["over_limit"]):
        print(line)
