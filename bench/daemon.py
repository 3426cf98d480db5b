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
the host tier only (the disk tier's write-behind would measure the disk, not the daemon), the
daemon's own shared-memory slots (``[shm]`` defaults: chunks larger than a slot are read from
the shared host pool), more of them only for more than ``DEFAULT_SLOTS / SLOTS_PER_CLIENT``
clients, and with tenants on: a tenants file, one tenant (and bearer token) per client, each
naming its own tenant in its namespace.

``--processes N`` then measures N client processes getting at once (each its own tenant and
chunks, started together): their aggregate GB/s against one client's.

Every figure comes from ``--rounds`` rounds (bench/rounds.py): each round measures both paths
(and the processes) and both limits, in an order that reverses every round; printed as median
(min-max), a ratio as the median of the per-round ratios. The JSON keeps every round, and
flags any round in which a path beat its round's limit by more than 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from bench.cli import UsageError
from bench.daemon_credentials import Credential, tenants_file
from bench.daemon_paths import PathBench, cpu_seconds
from bench.daemon_processes import Aggregate, worker
from bench.daemon_report import make_report, print_report
from bench.limits import GB, STREAMS, memcpy_limit, socket_limit
from bench.rounds import ROUNDS, in_turns
from kvstore.client import Client
from kvstore.config import parse_size
from kvstore.daemon.config import ShmConfig
from kvstore.daemon.spawn import DaemonProcess
from kvstore.keys import Namespace
from kvstore.wire.malloc import keep_large_blocks_in_heap

DEFAULT_SLOTS = ShmConfig().slots
SLOTS_PER_CLIENT = 16  # a Get of --batch chunks takes a slot each, a put one more

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


def _namespace(chunk_bytes: int) -> Namespace:
    if chunk_bytes <= 0 or chunk_bytes % (2 * 2 * TOKENS):
        raise UsageError(f"--chunk-bytes must be a positive multiple of {2 * 2 * TOKENS}")
    return Namespace("kvbench-daemon", 1, 1, chunk_bytes // (2 * 2 * TOKENS), "float16", TOKENS)


def _memcpy_pairs(chunk_bytes: int, sources: int, destinations: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The bytes the daemon moves as (dst, src) pairs: chunk after chunk out of ``sources``
    distinct chunks (as many as a client cycles over, so as cold in cache) into
    ``destinations`` reused buffers (as many as a batched get fills)."""
    src = [np.full(chunk_bytes, i, dtype=np.uint8) for i in range(sources)]
    dst = [np.zeros(chunk_bytes, dtype=np.uint8) for _ in range(destinations)]
    return [(dst[n % destinations], s) for n, s in enumerate(src)]


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
        return worker(args, ns)
    daemon = None
    tmp = None
    addr = args.addr
    if addr is not None:
        _check_reachable(args)
    creds = [Credential(token_file=args.auth_token_file)] * max(args.clients, args.processes)
    if addr is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvbench-daemon-")
        clients = max(args.clients, args.processes)
        tenants, creds = tenants_file(tmp.name, clients)
        host_bytes = max(256 << 20, 4 * clients * args.keys * (chunk_bytes + (256 << 10)))
        config = os.path.join(tmp.name, "daemon.toml")
        with open(config, "w") as f:
            f.write(f'listen = "127.0.0.1:0"\ntenants_file = "{tenants}"\n[store.host]\n'
                    f'capacity_bytes = {host_bytes}\n[store.disk]\nenabled = false\n'
                    + (f'[shm]\nslots = {SLOTS_PER_CLIENT * clients}\n'
                       if clients * SLOTS_PER_CLIENT > DEFAULT_SLOTS else ''))
        daemon = DaemonProcess(["--config", config])
        addr = daemon.addr

    sources, destinations = args.clients * args.keys, min(args.batch, args.keys)  # as many as the gets move
    pairs = _memcpy_pairs(chunk_bytes, sources, destinations)
    per_stream_s = args.seconds / 2 / len(STREAMS)

    def limits() -> dict:
        """Both limits, measured now, with the CPU seconds per GB their configurations spent."""
        cpu0 = cpu_seconds(None)
        sock = socket_limit(chunk_bytes, per_stream_s, sources, destinations)
        cpu1 = cpu_seconds(None)
        copy = memcpy_limit(pairs)
        cpu2 = cpu_seconds(None)
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
    report = make_report(rounds, paths, chunk_bytes, args)
    print_report(report, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
