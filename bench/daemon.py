"""``kvbench daemon``: put/get GB/s and latency through the daemon, against the machine's limits,
in one run.

- remote: the client's remote path (the bulk TCP side channel when the daemon offers it,
  else gRPC bytes); limit: raw loopback TCP moving the same chunks in the same run, the best
  of 1 to 4 streams (bench/limits.py).
- shm: the same-host shared-memory slots; limit: the best memcpy of the same bytes (from as
  many distinct chunks as the clients cycle over, into as many reused destinations as a
  batched get fills): one thread, threads over slices, or torch's copy.

Chunks are ``--chunk-bytes`` (fp16, one layer, one KV head, 256 tokens); each client cycles
over its own ``--keys`` chunks. Put is one chunk per call, always a new key (a put of a
present key is a no-op in the Store), so the host tier evicts once full. The get GB/s figure fetches
``--batch`` consecutive chunks per call (how the connector loads a prefix: the daemon reads
the next chunk while the previous one travels); latencies are per call, and a single-chunk
``get_into`` loop is reported beside it (``get_one_*``). Without ``--addr`` the benchmark starts its own daemon with
the host tier only (the disk tier's write-behind would measure the disk, not the daemon), and
with tenants on: a tenants file, one tenant (and bearer token) per client, each naming its
own tenant in its namespace.

``--processes N`` then measures N client processes getting at once (each its own tenant and
chunks, started together): their aggregate GB/s against one client's.

Every figure comes from ``--rounds`` rounds (bench/rounds.py): each round measures both paths
(and the processes) and both limits, in an order that reverses every round; printed as median
(min-max), a ratio as the median of the per-round ratios. The JSON keeps every round, and
flags any round in which a path beat its round's limit by more than 5%.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time

import argparse

import numpy as np

from bench.cli import UsageError
from bench.limits import STREAMS, Limit, memcpy_limit, socket_limit
from bench.rounds import ROUNDS, Spread, in_turns, limit_summary, over_limit, over_limit_lines, ratio
from kvstore.client import Client
from kvstore.config import parse_size
from kvstore.malloc import keep_large_blocks_in_heap
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import ChunkKey, Namespace

GB = 1e9
TOKENS = 256


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("daemon", help="daemon put/get GB/s, remote and shm, vs raw socket and memcpy")
    p.add_argument("--addr", default=None, help="a running daemon (default: start one)")
    p.add_argument("--auth-token-file", default=None)
    p.add_argument("--clients", type=int, default=1, help="concurrent clients (threads, one Client each)")
    p.add_argument("--chunk-bytes", default="4MiB", help="bytes per chunk (multiple of 1 KiB)")
    p.add_argument("--seconds", type=float, default=1.0, help="seconds per measurement, in each round")
    p.add_argument("--rounds", type=int, default=ROUNDS,
                   help="interleaved rounds of the paths and the limits; figures are their medians")
    p.add_argument("--keys", type=int, default=16, help="distinct chunks per client")
    p.add_argument("--batch", type=int, default=8,
                   help="chunks per get call for the GB/s figure (a prefix is fetched in one call)")
    p.add_argument("--processes", type=int, default=0,
                   help="also measure this many client processes getting at once (aggregate GB/s)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    # one of the --processes: a round's measurement for each line on stdin, its result a line on stdout
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--transport", default="shm", help=argparse.SUPPRESS)
    p.add_argument("--token", default=None, help=argparse.SUPPRESS)
    p.add_argument("--tenant", default="", help=argparse.SUPPRESS)
    p.set_defaults(func=run)


@dataclasses.dataclass(frozen=True)
class Credential:
    """How one client authenticates, and the tenant its namespace names."""

    token: str | None = None
    token_file: str | None = None
    tenant: str = ""


def _tenants(root: str, count: int) -> tuple[str, list[Credential]]:
    """A tenants file with ``count`` tenants, and their credentials."""
    creds = [Credential(token=f"kvbench-token-{i}", tenant=f"bench{i}") for i in range(count)]
    path = os.path.join(root, "tenants.toml")
    with open(path, "w") as f:
        for c in creds:
            f.write(f'[tenants.{c.tenant}]\ntoken_sha256 = "{hashlib.sha256(c.token.encode()).hexdigest()}"\n')
    return path, creds


def _namespace(chunk_bytes: int) -> Namespace:
    if chunk_bytes <= 0 or chunk_bytes % (2 * 2 * TOKENS):
        raise UsageError(f"--chunk-bytes must be a positive multiple of {2 * 2 * TOKENS}")
    return Namespace("kvbench-daemon", 1, 1, chunk_bytes // (2 * 2 * TOKENS), "float16", TOKENS)


def _cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of this process, or of ``pid`` (Linux /proc); 0 if unknown."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _summary(latencies: list[float], nbytes: int, elapsed: float, cpu: tuple[float, float]) -> dict:
    lat = np.array(latencies) if latencies else np.array([float("nan")])
    return {
        "gbps": nbytes / elapsed / GB if elapsed > 0 else 0.0,
        "p50_s": float(np.percentile(lat, 50)),
        "p99_s": float(np.percentile(lat, 99)),
        "ops": len(latencies),
        # CPU seconds per GB moved, clients and daemon: comparable on a busy machine, where
        # wall-clock GB/s depends on what else runs
        "client_cpu_s_per_gb": cpu[0] / (nbytes / GB) if nbytes else 0.0,
        "daemon_cpu_s_per_gb": cpu[1] / (nbytes / GB) if nbytes else 0.0,
    }


def _measure(clients: list[Client], work, seconds: float, daemon_pid: int | None) -> dict:
    """Run ``work(client, index, deadline, latencies)`` in one thread per client."""
    latencies: list[list[float]] = [[] for _ in clients]
    done = [0] * len(clients)
    failed: list[BaseException] = []
    barrier = threading.Barrier(len(clients) + 1)

    def worker(i: int) -> None:
        barrier.wait()
        try:
            done[i] = work(clients[i], i, time.perf_counter() + seconds, latencies[i])
        except BaseException as exc:  # raised below: a failed client is no figure of 0 GB/s
            failed.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    cpu0 = (_cpu_seconds(None), _cpu_seconds(daemon_pid) if daemon_pid else 0.0)
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    cpu = (_cpu_seconds(None) - cpu0[0], (_cpu_seconds(daemon_pid) - cpu0[1]) if daemon_pid else 0.0)
    if failed:
        raise failed[0]
    return _summary([x for lat in latencies for x in lat], sum(done), elapsed, cpu)


class PathBench:
    """One transport's clients (``--clients``, one thread each), connected once and measured
    in every round: put, batched get, single-chunk get."""

    def __init__(self, addr: str, transport: str, args, ns: Namespace, daemon_pid: int | None,
                 creds: list[Credential]) -> None:
        import torch  # here, not at the top: a mistyped argument or an absent daemon fails without its ~1 s

        self.transport, self.args, self.daemon_pid = transport, args, daemon_pid
        self.clients = []
        for c in creds[: args.clients]:
            self.clients.append(Client(addr, transport=transport, token=c.token, token_file=c.token_file,
                                       timeout_s=60))
        self.ns = [dataclasses.replace(ns, tenant=c.tenant) for c in creds[: args.clients]]
        self.used = self.clients[0].path
        self.keys: list[list[ChunkKey]] = [[] for _ in self.clients]
        self.chunk = torch.randn(ns.chunk_shape).to(torch.float16)
        self.nbytes = self.chunk.numel() * 2
        self.batch = min(args.batch, args.keys)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def _put(self, r: int):
        def put(client: Client, i: int, deadline: float, lat: list[float]) -> int:
            """Fresh keys only, new in every round (a put of a present key is a no-op in the
            Store); the last ``--keys`` stay for the get phase."""
            n = 0
            while time.perf_counter() < deadline or n < self.args.keys:
                name = f"{self.transport}/{r}/{i}/{n}".encode()
                key = ChunkKey(self.ns[i], hashlib.blake2b(name, digest_size=16).digest())
                t0 = time.perf_counter()
                client.put(key, self.chunk)
                lat.append(time.perf_counter() - t0)
                self.keys[i] = (self.keys[i] + [key])[-self.args.keys :]
                n += 1
            return n * self.nbytes
        return put

    def _get(self, client: Client, i: int, deadline: float, lat: list[float]) -> int:
        import torch

        batch, keys = self.batch, self.keys[i]
        outs = [torch.zeros_like(self.chunk) for _ in range(batch)]  # reused, as a connector's staging buffers
        n = 0
        while time.perf_counter() < deadline:
            start = (n * batch) % (len(keys) - batch + 1)
            t0 = time.perf_counter()
            got = client.get_many_into(keys[start : start + batch], outs)
            lat.append(time.perf_counter() - t0)
            if got != batch:
                raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
            n += 1
        return n * batch * self.nbytes

    def _get_one(self, client: Client, i: int, deadline: float, lat: list[float]) -> int:
        import torch

        out = torch.zeros_like(self.chunk)
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            if not client.get_into(self.keys[i][n % len(self.keys[i])], out):
                raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
            lat.append(time.perf_counter() - t0)
            n += 1
        return n * self.nbytes

    def round(self, r: int) -> dict:
        """The previous round's chunks deleted first (outside the timing): read many times, they
        would outrank this round's fresh puts in the host tier's eviction, which then evicts
        chunks this round is about to get; and so every round starts from the same state."""
        for client, keys in zip(self.clients, self.keys):
            if keys:
                client.delete(keys)
        self.keys = [[] for _ in self.clients]
        seconds = self.args.seconds
        p = _measure(self.clients, self._put(r), seconds, self.daemon_pid)
        g = _measure(self.clients, self._get, seconds, self.daemon_pid)
        g1 = _measure(self.clients, self._get_one, seconds / 2, self.daemon_pid)
        result = {}
        for prefix, figures in (("put", p), ("get", g), ("get_one", g1)):
            result.update({f"{prefix}_{name}": value for name, value in figures.items()})
        return result


def _memcpy_pairs(chunk_bytes: int, sources: int, destinations: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The bytes the daemon moves as (dst, src) pairs: chunk after chunk out of ``sources``
    distinct chunks (as many as a client cycles over, so as cold in cache) into
    ``destinations`` reused buffers (as many as a batched get fills)."""
    src = [np.full(chunk_bytes, i, dtype=np.uint8) for i in range(sources)]
    dst = [np.zeros(chunk_bytes, dtype=np.uint8) for _ in range(destinations)]
    return [(dst[n % destinations], s) for n, s in enumerate(src)]


def _worker(args, ns: Namespace) -> int:
    """One of ``--processes``: put its chunks, say ``ready`` on stdout, then for each line on
    stdin get in a loop for ``--seconds`` and answer one JSON line; end when stdin closes. A
    Ctrl-C in a terminal reaches it too: it leaves the ending to its parent, which kills it and
    alone says so."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    ns = dataclasses.replace(ns, tenant=args.tenant)
    with Client(args.addr, transport=args.transport, token=args.token, token_file=args.auth_token_file,
                timeout_s=60) as client:
        chunk = torch.randn(ns.chunk_shape).to(torch.float16)
        keys = [ChunkKey(ns, hashlib.blake2b(f"{args.tenant}/{n}".encode(), digest_size=16).digest())
                for n in range(args.keys)]
        for k in keys:
            client.put(k, chunk)
        batch = min(args.batch, args.keys)
        outs = [torch.zeros_like(chunk) for _ in range(batch)]
        print("ready", flush=True)
        for _ in sys.stdin:  # blocks between rounds, spending no CPU the paths measured meanwhile need
            start = time.perf_counter()
            deadline, n = start + args.seconds, 0
            while time.perf_counter() < deadline:
                first = (n * batch) % (len(keys) - batch + 1)
                if client.get_many_into(keys[first : first + batch], outs) != batch:
                    raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
                n += 1
            elapsed = time.perf_counter() - start
            print(json.dumps({"bytes": n * batch * chunk.numel() * 2, "elapsed": elapsed}), flush=True)
    return 0


class Aggregate:
    """``--processes`` client processes of one transport, started once and told to get at once
    in every round: their aggregate GB/s."""

    def __init__(self, addr: str, transport: str, args, creds: list[Credential]) -> None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.procs = []
        try:
            for c in creds[: args.processes]:
                cmd = [sys.executable, "-m", "bench", "daemon", "--worker", "--addr", addr, "--transport",
                       transport, "--tenant", c.tenant, "--chunk-bytes", args.chunk_bytes, "--seconds",
                       str(args.seconds), "--keys", str(args.keys), "--batch", str(args.batch)]
                cmd += ["--token", c.token] if c.token else ["--auth-token-file", c.token_file] if c.token_file else []
                self.procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                                   env={**os.environ, "PYTHONPATH": root}))
            if any(p.stdout.readline().strip() != "ready" for p in self.procs):
                raise RuntimeError("a benchmark client process failed to start")
        except BaseException:
            self.close()
            raise

    def round(self) -> dict:
        for p in self.procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        lines = [p.stdout.readline() for p in self.procs]
        if not all(lines):
            raise RuntimeError("a benchmark client process failed")
        results = [json.loads(line) for line in lines]
        total = sum(r["bytes"] for r in results)
        return {"processes": len(results), "get_gbps": total / max(r["elapsed"] for r in results) / GB,
                "per_process_gbps": [r["bytes"] / r["elapsed"] / GB for r in results]}

    def close(self) -> None:
        """Each process ends when its stdin closes; one that does not within a minute is killed."""
        for p in self.procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _check_reachable(args) -> None:
    """Refuse at once, in one line, a ``--addr`` where no daemon answers (before the baselines
    spend seconds)."""
    with Client(args.addr, transport="grpc", token=args.token, token_file=args.auth_token_file, timeout_s=5) as client:
        status, _ = client.ping()
    if status != "SERVING":
        raise UsageError(f"the daemon at {args.addr} is {status}")


def run(args) -> int:
    if min(args.clients, args.seconds, args.keys, args.batch, args.rounds) <= 0 or args.processes < 0:
        raise UsageError("--clients, --seconds, --keys, --batch and --rounds must be positive")
    chunk_bytes = parse_size(args.chunk_bytes)
    ns = _namespace(chunk_bytes)
    keep_large_blocks_in_heap()
    if args.worker:
        return _worker(args, ns)
    daemon = None
    tmp = None
    addr = args.addr
    if addr is not None:
        _check_reachable(args)
    creds = [Credential(token_file=args.auth_token_file)] * max(args.clients, args.processes)
    if addr is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvbench-daemon-")
        clients = max(args.clients, args.processes)
        tenants_file, creds = _tenants(tmp.name, clients)
        host_bytes = max(256 << 20, 4 * clients * args.keys * (chunk_bytes + (256 << 10)))
        config = os.path.join(tmp.name, "daemon.toml")
        with open(config, "w") as f:
            f.write(f'listen = "127.0.0.1:0"\ntenants_file = "{tenants_file}"\n[store.host]\n'
                    f'capacity_bytes = {host_bytes}\n[store.disk]\nenabled = false\n'
                    f'[shm]\nslot_bytes = {-(-chunk_bytes // 4096) * 4096 + 4096}\nslots = {max(64, 16 * clients)}\n')
        daemon = DaemonProcess(["--config", config])
        addr = daemon.addr

    pairs = _memcpy_pairs(chunk_bytes, args.clients * args.keys, min(args.batch, args.keys))
    per_stream_s = args.seconds / 2 / len(STREAMS)

    def limits() -> dict:
        """Both limits, measured now, with the CPU seconds per GB their configurations spent."""
        cpu0 = _cpu_seconds(None)
        sock = socket_limit(chunk_bytes, per_stream_s)
        cpu1 = _cpu_seconds(None)
        copy = memcpy_limit(pairs)
        cpu2 = _cpu_seconds(None)
        moved_sock = sum(sock.tried.values()) * per_stream_s
        moved_copy = len(copy.tried) * 3 * len(pairs) * chunk_bytes / GB  # memcpy_limit's 3 repeats per config
        return {"socket_limit": sock, "socket_cpu_s_per_gb": (cpu1 - cpu0) / moved_sock,
                "memcpy_limit": copy, "memcpy_cpu_s_per_gb": (cpu2 - cpu1) / moved_copy}

    pid = daemon.proc.pid if daemon else None
    opened: list = []
    rounds = []
    try:
        paths, aggregates = {}, {}
        for t in ("remote", "shm"):  # each kept in `opened` at once, so a later failure still closes it
            paths[t] = PathBench(addr, t, args, ns, pid, creds)
            opened.append(paths[t])
        for t in ("remote", "shm") if args.processes else ():
            aggregates[t] = Aggregate(addr, t, args, creds)
            opened.append(aggregates[t])
        steps = [(name, lambda r, p=p: p.round(r)) for name, p in paths.items()]
        steps += [(f"aggregate_{name}", lambda r, a=a: a.round()) for name, a in aggregates.items()]
        steps += [("limits", lambda r: limits())]
        for r in range(args.rounds):
            results = dict(zip([name for name, _ in steps], in_turns(r, *[lambda f=f: f(r) for _, f in steps])))
            results.update(results.pop("limits"))
            rounds.append(results)
    finally:
        for o in opened:
            o.close()
        if daemon is not None:
            daemon.stop()
        if tmp is not None:
            tmp.cleanup()
    report = _report(rounds, paths, chunk_bytes, args)
    _print(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _report(rounds: list[dict], paths: dict[str, PathBench], chunk_bytes: int, args) -> dict:
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


def _print(report: dict, args) -> None:
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
