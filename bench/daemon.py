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
from bench.limits import STREAMS, Limit, memcpy_limit, over_limit, socket_limit
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
    p.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    p.add_argument("--keys", type=int, default=16, help="distinct chunks per client")
    p.add_argument("--batch", type=int, default=8,
                   help="chunks per get call for the GB/s figure (a prefix is fetched in one call)")
    p.add_argument("--processes", type=int, default=0,
                   help="also measure this many client processes getting at once (aggregate GB/s)")
    p.add_argument("--json", default=None, help="write the results as JSON here")
    # one of the --processes: measure in DIR, started when DIR/go appears
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
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
    barrier = threading.Barrier(len(clients) + 1)

    def worker(i: int) -> None:
        barrier.wait()
        done[i] = work(clients[i], i, time.perf_counter() + seconds, latencies[i])

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
    return _summary([x for lat in latencies for x in lat], sum(done), elapsed, cpu)


def _path(addr: str, transport: str, args, ns: Namespace, daemon_pid: int | None, creds: list[Credential]) -> dict:
    import torch  # here, not at the top: a mistyped argument or an absent daemon fails without its ~1 s

    clients = [Client(addr, transport=transport, token=c.token, token_file=c.token_file, timeout_s=60)
               for c in creds[: args.clients]]
    tenant_ns = [dataclasses.replace(ns, tenant=c.tenant) for c in creds[: args.clients]]
    try:
        used = clients[0].path
        keys: list[list[ChunkKey]] = [[] for _ in clients]
        chunk = torch.randn(ns.chunk_shape).to(torch.float16)
        nbytes = chunk.numel() * 2

        def put(client: Client, i: int, deadline: float, lat: list[float]) -> int:
            """Fresh keys only (a put of a present key is a no-op in the Store); the last
            ``--keys`` stay for the get phase."""
            n = 0
            while time.perf_counter() < deadline or n < args.keys:
                key = ChunkKey(tenant_ns[i], hashlib.blake2b(f"{transport}/{i}/{n}".encode(), digest_size=16).digest())
                t0 = time.perf_counter()
                client.put(key, chunk)
                lat.append(time.perf_counter() - t0)
                keys[i] = (keys[i] + [key])[-args.keys :]
                n += 1
            return n * nbytes

        batch = min(args.batch, args.keys)

        def get(client: Client, i: int, deadline: float, lat: list[float]) -> int:
            outs = [torch.zeros_like(chunk) for _ in range(batch)]  # reused, as a connector's staging buffers
            n = 0
            while time.perf_counter() < deadline:
                start = (n * batch) % (len(keys[i]) - batch + 1)
                t0 = time.perf_counter()
                got = client.get_many_into(keys[i][start : start + batch], outs)
                lat.append(time.perf_counter() - t0)
                if got != batch:
                    raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
                n += 1
            return n * batch * nbytes

        def get_one(client: Client, i: int, deadline: float, lat: list[float]) -> int:
            out = torch.zeros_like(chunk)
            n = 0
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                if not client.get_into(keys[i][n % len(keys[i])], out):
                    raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
                lat.append(time.perf_counter() - t0)
                n += 1
            return n * nbytes

        p = _measure(clients, put, args.seconds, daemon_pid)
        g = _measure(clients, get, args.seconds, daemon_pid)
        g1 = _measure(clients, get_one, args.seconds / 2, daemon_pid)
        result = {"transport": used, "get_batch": batch}
        for prefix, figures in (("put", p), ("get", g), ("get_one", g1)):
            result.update({f"{prefix}_{name}": value for name, value in figures.items()})
        return result
    finally:
        for c in clients:
            c.close()


def _memcpy_pairs(chunk_bytes: int, sources: int, destinations: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The bytes the daemon moves as (dst, src) pairs: chunk after chunk out of ``sources``
    distinct chunks (as many as a client cycles over, so as cold in cache) into
    ``destinations`` reused buffers (as many as a batched get fills)."""
    src = [np.full(chunk_bytes, i, dtype=np.uint8) for i in range(sources)]
    dst = [np.zeros(chunk_bytes, dtype=np.uint8) for _ in range(destinations)]
    return [(dst[n % destinations], s) for n, s in enumerate(src)]


def _worker(args, ns: Namespace) -> int:
    """One of ``--processes``: put its chunks, say ready, get in a loop once told to go. A
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
        with open(os.path.join(args.worker, f"ready-{os.getpid()}"), "w"):
            pass
        while not os.path.exists(os.path.join(args.worker, "go")):
            time.sleep(0.001)
        start = time.perf_counter()
        deadline, n = start + args.seconds, 0
        while time.perf_counter() < deadline:
            first = (n * batch) % (len(keys) - batch + 1)
            if client.get_many_into(keys[first : first + batch], outs) != batch:
                raise RuntimeError("a chunk the benchmark stored is missing (host tier too small?)")
            n += 1
        elapsed = time.perf_counter() - start
    with open(os.path.join(args.worker, f"result-{os.getpid()}.json"), "w") as f:
        json.dump({"bytes": n * batch * chunk.numel() * 2, "elapsed": elapsed}, f)
    return 0


def _aggregate(addr: str, transport: str, args, creds: list[Credential]) -> dict:
    """``--processes`` client processes getting at once: their aggregate GB/s."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with tempfile.TemporaryDirectory(prefix="kvbench-daemon-procs-") as work:
        procs = []
        for c in creds[: args.processes]:
            cmd = [sys.executable, "-m", "bench", "daemon", "--worker", work, "--addr", addr, "--transport", transport,
                   "--tenant", c.tenant, "--chunk-bytes", args.chunk_bytes, "--seconds", str(args.seconds),
                   "--keys", str(args.keys), "--batch", str(args.batch)]
            cmd += ["--token", c.token] if c.token else ["--auth-token-file", c.token_file] if c.token_file else []
            procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": root}))
        try:
            deadline = time.monotonic() + 300
            while sum(n.startswith("ready-") for n in os.listdir(work)) < len(procs):
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError("a benchmark client process failed to start")
                time.sleep(0.05)
            with open(os.path.join(work, "go"), "w"):
                pass
            if any(p.wait() != 0 for p in procs):
                raise RuntimeError("a benchmark client process failed")
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        results = [json.load(open(os.path.join(work, n))) for n in os.listdir(work) if n.startswith("result-")]
    total = sum(r["bytes"] for r in results)
    return {"processes": len(results), "get_gbps": total / max(r["elapsed"] for r in results) / GB,
            "per_process_gbps": [r["bytes"] / r["elapsed"] / GB for r in results]}


def _check_reachable(args) -> None:
    """Refuse at once, in one line, a ``--addr`` where no daemon answers (before the baselines
    spend seconds)."""
    with Client(args.addr, transport="grpc", token=args.token, token_file=args.auth_token_file, timeout_s=5) as client:
        status, _ = client.ping()
    if status != "SERVING":
        raise UsageError(f"the daemon at {args.addr} is {status}")


def run(args) -> int:
    if args.clients <= 0 or args.seconds <= 0 or args.keys <= 0 or args.batch <= 0 or args.processes < 0:
        raise UsageError("--clients, --seconds, --keys and --batch must be positive")
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

    def baselines() -> tuple[Limit, float, Limit, float]:
        """(socket limit, CPU s/GB over its configs, memcpy limit, CPU s/GB over its configs), measured now."""
        cpu0 = _cpu_seconds(None)
        sock = socket_limit(chunk_bytes, per_stream_s)
        cpu1 = _cpu_seconds(None)
        copy = memcpy_limit(pairs)
        cpu2 = _cpu_seconds(None)
        moved_sock = sum(sock.tried.values()) * per_stream_s
        moved_copy = len(copy.tried) * 3 * len(pairs) * chunk_bytes / GB  # memcpy_limit's 3 repeats per config
        return sock, (cpu1 - cpu0) / moved_sock, copy, (cpu2 - cpu1) / moved_copy

    try:
        before = baselines()
        pid = daemon.proc.pid if daemon else None
        results = {
            "chunk_bytes": chunk_bytes, "clients": args.clients, "seconds": args.seconds,
            "tenants": args.addr is None,
            "remote": _path(addr, "remote", args, ns, pid, creds),
            "shm": _path(addr, "shm", args, ns, pid, creds),
        }
        if args.processes:
            results["aggregate"] = {t: _aggregate(addr, t, args, creds) for t in ("remote", "shm")}
        after = baselines()
    finally:
        if daemon is not None:
            daemon.stop()
        if tmp is not None:
            tmp.cleanup()
    # the machine may be busier at one moment than another: compare against the better of the
    # baselines measured before and after the daemon paths (the conservative choice)
    sock = max(before[0], after[0], key=lambda limit: limit.gbps)
    copy = max(before[2], after[2], key=lambda limit: limit.gbps)
    results["socket_gbps"], results["socket_limit"] = sock.gbps, sock.as_dict()
    results["memcpy_gbps"], results["memcpy_limit"] = copy.gbps, copy.as_dict()
    results["socket_gbps_before_after"] = [before[0].gbps, after[0].gbps]
    results["memcpy_gbps_before_after"] = [before[2].gbps, after[2].gbps]
    results["socket_cpu_s_per_gb"] = min(before[1], after[1])
    results["memcpy_cpu_s_per_gb"] = min(before[3], after[3])
    results["ratios"] = {
        "remote_get_vs_socket": results["remote"]["get_gbps"] / results["socket_gbps"],
        "remote_put_vs_socket": results["remote"]["put_gbps"] / results["socket_gbps"],
        "shm_get_vs_memcpy": results["shm"]["get_gbps"] / results["memcpy_gbps"],
        "shm_put_vs_memcpy": results["shm"]["put_gbps"] / results["memcpy_gbps"],
    }
    print(f"chunk {chunk_bytes} B, {args.clients} client(s), {args.seconds:g} s per figure")
    for name in ("remote", "shm"):
        r = results[name]
        print(f"{name:6} ({r['transport']:4}) put {r['put_gbps']:6.2f} GB/s p50 {r['put_p50_s'] * 1e3:7.2f} ms "
              f"p99 {r['put_p99_s'] * 1e3:7.2f} ms | get x{r['get_batch']} {r['get_gbps']:6.2f} GB/s "
              f"p50 {r['get_p50_s'] * 1e3:7.2f} ms p99 {r['get_p99_s'] * 1e3:7.2f} ms | get x1 "
              f"{r['get_one_gbps']:6.2f} GB/s p50 {r['get_one_p50_s'] * 1e3:7.2f} ms p99 {r['get_one_p99_s'] * 1e3:7.2f} ms")
    for name in ("remote", "shm"):
        r = results[name]
        print(f"{name:6} CPU s/GB (client + daemon): put {r['put_client_cpu_s_per_gb']:.2f} + "
              f"{r['put_daemon_cpu_s_per_gb']:.2f}, get x{r['get_batch']} {r['get_client_cpu_s_per_gb']:.2f} + "
              f"{r['get_daemon_cpu_s_per_gb']:.2f}")
    print(f"limits: raw loopback socket {results['socket_gbps']:.2f} GB/s ({sock.config}; "
          f"{results['socket_cpu_s_per_gb']:.2f} CPU s/GB), memcpy {results['memcpy_gbps']:.2f} GB/s ({copy.config}; "
          f"{results['memcpy_cpu_s_per_gb']:.2f} CPU s/GB); best configuration, better of before/after")
    for name, agg in results.get("aggregate", {}).items():
        agg["vs_one_client"] = agg["get_gbps"] / results[name]["get_gbps"]
        print(f"{name:6} {agg['processes']} processes at once: get {agg['get_gbps']:.2f} GB/s in all = "
              f"{agg['vs_one_client']:.2f}x one client's")
    results["over_limit"] = (over_limit({f"{n} {op}": results[n][f"{op}_gbps"] for n in ("remote",) for op in ("put", "get")}, sock)
                             + over_limit({f"shm {op}": results["shm"][f"{op}_gbps"] for op in ("put", "get")}, copy))
    for w in results["over_limit"]:
        print(f"warning: {w}", file=sys.stderr)
    q = results["ratios"]
    print(f"remote get {q['remote_get_vs_socket']:.2f}x socket, shm get {q['shm_get_vs_memcpy']:.2f}x memcpy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
