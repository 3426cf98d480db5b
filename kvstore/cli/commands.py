"""The ``kvstore`` command: run the daemon, talk to it, operate a store's data on this host.

Errors a user can cause print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time

from kvstore.config import ConfigError, StoreConfig, format_size, load_config, parse_size, to_toml


class UsageError(Exception):
    """A mistake in the command line: one line on stderr, exit code 2."""


def _load(args) -> StoreConfig:
    cfg = load_config(args.config) if args.config else StoreConfig()
    if getattr(args, "data_dir", None):
        cfg.disk.path = args.data_dir
    return cfg


def cmd_config(args) -> int:
    """Print a configuration as TOML: the store's (defaults merged with ``--config``), or with
    ``--daemon`` the running daemon's at ``--addr`` (or, with ``--config``, what
    ``kvstore serve --config FILE`` would run with)."""
    if args.daemon and not args.config:
        with _client(args) as client:
            print(client.config(), end="")
        return 0
    if args.daemon:
        from kvstore.daemon.config import DaemonConfig

        cfg = load_config(args.config, DaemonConfig)
    else:
        cfg = _load(args)
    print(to_toml(cfg), end="")
    return 0


def cmd_fsck(args) -> int:
    """Verify every blob in the disk tier's directory; exit 1 if anything is bad."""
    from kvstore.cli.fsck import fsck  # torch: loaded only by the commands that read blobs

    cfg = _load(args)
    report = fsck(cfg.disk.path, repair=args.repair)
    print(f"{cfg.disk.path}: {report.blobs} blobs, {report.bytes} bytes, "
          f"{len(report.corrupt)} corrupt, {len(report.temporary)} temporary files")
    for path, reason in report.corrupt:
        print(f"corrupt: {path}: {reason}")
    if args.repair:
        print(f"removed {report.removed} files")
    return 1 if (report.corrupt or report.temporary) and not args.repair else 0


def _daemon_config(args):
    from kvstore.daemon.config import DaemonConfig

    cfg = load_config(args.config, DaemonConfig) if args.config else DaemonConfig()
    if args.listen:
        cfg.listen = args.listen
    if args.data_dir:
        cfg.store.disk.path = args.data_dir
    if args.host_bytes:
        cfg.store.host.capacity_bytes = parse_size(args.host_bytes)
    if args.disk_bytes:
        cfg.store.disk.capacity_bytes = parse_size(args.disk_bytes)
    if args.metrics:
        cfg.metrics = args.metrics
    if args.auth_token_file:
        cfg.auth_token_file = args.auth_token_file
    if args.tenants_file:
        cfg.tenants_file = args.tenants_file
    if args.tls_client_ca:
        cfg.tls_client_ca = args.tls_client_ca
    if args.tls_cert or args.tls_key:
        if not (args.tls_cert and args.tls_key):
            raise UsageError("--tls-cert and --tls-key go together")
        cfg.tls_cert, cfg.tls_key = args.tls_cert, args.tls_key
    if args.no_shm:
        cfg.shm.enabled = False
    if args.no_bulk:
        cfg.bulk.enabled = False
    return cfg


def cmd_serve(args) -> int:
    """Run the daemon in the foreground until SIGTERM/SIGINT. The configuration and the
    addresses are checked before the daemon (and torch) is imported: a typo fails at once."""
    from kvstore.wire.malloc import keep_large_blocks_in_heap, limit_arenas
    from kvstore.wire.convert import split_host_port

    cfg = _daemon_config(args)
    addresses = [split_host_port(a) for a in (cfg.metrics, cfg.listen) if a]  # every typo before any bind
    for address in addresses:
        _check_bindable(*address)
    from kvstore.daemon.server import serve
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    keep_large_blocks_in_heap()
    limit_arenas(max(2, os.cpu_count() or 2))
    try:
        asyncio.run(serve(cfg))
    except RuntimeError as exc:
        if "bind" in str(exc).lower():  # grpc: the address is taken or not ours
            raise UsageError(f"cannot listen on {cfg.listen}: {exc}") from None
        raise
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Exit without the interpreter's teardown, once the daemon has stopped cleanly (Store
    flushed and closed, its files removed, "stopped" logged): with torch loaded that teardown
    takes a second, which every stop and restart would wait for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_bindable(host: str, port: int) -> None:
    """Fail early, in one line, when an address is taken (before the Store is built)."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _client(args):
    from kvstore.client import Client

    return Client(args.addr, token_file=args.auth_token_file, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                  tls_key=args.tls_key, timeout_s=args.timeout, transport="grpc")


def cmd_stats(args) -> int:
    """Print tiers, usage and hit rates of a running daemon, sizes in binary units; with
    ``--watch S``, again every S seconds with each tier's read and write rates (a terminal
    ``top``: the screen is redrawn when stdout is a terminal)."""
    if args.watch is not None and not args.watch > 0:
        raise UsageError(f"--watch takes a positive number of seconds, got {args.watch}")
    if args.count is not None and args.count < 1:
        raise UsageError(f"--count must be at least 1, got {args.count}")
    redraw = args.watch is not None and sys.stdout.isatty()
    with _client(args) as client:
        previous, samples = None, 0
        while True:
            s, now = client.stats(), time.monotonic()
            if redraw:
                print("\x1b[H\x1b[2J", end="")
            _print_stats(args.addr, s, previous and (previous[0], now - previous[1]))
            samples += 1
            if args.watch is None or samples == args.count:
                return 0
            sys.stdout.flush()
            previous = (s, now)
            time.sleep(args.watch)


def _print_stats(addr: str, s, since=None) -> None:
    """One screen of stats; ``since`` = (earlier stats, seconds ago) adds per-tier rates."""
    total = s.hits + s.misses
    print(f"daemon {addr}: {s.chunks} chunks, {s.puts} puts, {s.hits} hits, {s.misses} misses "
          f"(hit rate {s.hits / total if total else 0:.1%}), {s.pinned} pinned")
    print(f"write-behind: {s.write_behind_queue} queued, {format_size(s.write_behind_pending_bytes)} pending, "
          f"{s.write_behind_dropped} dropped")
    print(f"{'tier':8} {'used':>9} {'capacity':>9} {'use':>6} {'chunks':>8} {'hits':>8} {'misses':>8} "
          f"{'hit rate':>8} {'evictions':>9} {'corrupt':>7} {'errors':>6}" + (f" {'read/s':>10} {'write/s':>10}" if since else ""))
    for t in s.tiers.values():
        seen = t.hits + t.misses
        line = (f"{t.name:8} {format_size(t.used_bytes):>9} {format_size(t.capacity_bytes):>9} "
                f"{t.used_bytes / max(1, t.capacity_bytes):>6.1%} {t.chunks:>8} {t.hits:>8} {t.misses:>8} "
                f"{t.hits / seen if seen else 0:>8.1%} {t.evictions:>9} {t.corruptions:>7} {t.errors:>6}")
        if since:
            before, seconds = since[0].tiers.get(t.name, t), max(since[1], 1e-9)
            line += (f" {format_size(int((t.bytes_read - before.bytes_read) / seconds)) + '/s':>10}"
                     f" {format_size(int((t.bytes_written - before.bytes_written) / seconds)) + '/s':>10}")
        print(line)


def cmd_ping(args) -> int:
    """Check that a daemon answers its health service; exit 1 if it is not serving."""
    with _client(args) as client:
        status, seconds = client.ping()
    print(f"{args.addr}: {status} in {seconds * 1e3:.2f} ms")
    return 0 if status == "SERVING" else 1


def cmd_cluster(args) -> int:
    """Print a cluster's members (heartbeats, pins, usage), its shared tiers' budgets and use,
    and its health, from the ledger in the shared index's Redis (docs/cluster.md); exit 1
    when it is not healthy (Redis Cluster not ok or a node failed, a tier over its budget)."""
    import dataclasses
    import json

    from kvstore.daemon.config import DaemonConfig
    from kvstore.cluster.ledger import Ledger
    from tiers.url import redact_url

    store = (load_config(args.config, DaemonConfig) if args.config else DaemonConfig()).store
    si = store.shared_index
    url, prefix = args.url or si.url, args.key_prefix or si.key_prefix
    redis_cluster = args.redis_cluster or si.cluster
    ledger = Ledger(url, prefix, redis_cluster, si.socket_timeout_s)
    try:
        state, health = ledger.state(store.cluster.member_ttl_s), ledger.health()
    finally:
        ledger.close()
    problems = [f"redis cluster state {health['redis']}"] if health["redis"] != "ok" else []
    problems += [f"node {a} failed" for a in health.get("failed", [])]
    problems += [f"{n} uses {format_size(t.used_bytes)} of a {format_size(t.budget_bytes)} budget"
                 for n, t in state.tiers.items() if t.used_bytes > t.budget_bytes]
    if args.json:
        print(json.dumps({"shared_index": {"url": redact_url(url), "key_prefix": prefix, "cluster": redis_cluster},
                          "members": [dataclasses.asdict(m) for m in state.members],
                          "tiers": {n: dataclasses.asdict(t) for n, t in state.tiers.items()},
                          "health": {**health, "ok": not problems, "problems": problems}}, indent=1))
        return 1 if problems else 0
    live = sum(m.live for m in state.members)
    print(f"cluster at {redact_url(url)} (prefix {prefix}): {live} live members, {len(state.members) - live} not live; "
          f"health: {'ok' if not problems else '; '.join(problems)}")
    print(f"{'member':40} {'state':5} {'address':21} {'heartbeat':>10} {'pins':>6} " + " ".join(f"{n:>9}" for n in state.tiers))
    for m in state.members:
        status = "live" if m.live else ("left" if m.heartbeat_age_s is None else "dead")
        beat = "-" if m.heartbeat_age_s is None else f"{m.heartbeat_age_s:.1f}s ago"
        usage = " ".join(f"{format_size(t.by_member.get(m.name, 0)):>9}" for t in state.tiers.values())
        print(f"{m.name:40} {status:5} {m.info.get('addr') or '-':21} {beat:>10} {m.pins:>6} {usage}")
    print(f"{'tier':8} {'used':>9} {'budget':>9} {'use':>6} {'chunks':>8} {'in flight':>9}")
    for n, t in state.tiers.items():
        print(f"{n:8} {format_size(t.used_bytes):>9} {format_size(t.budget_bytes):>9} "
              f"{t.used_bytes / max(1, t.budget_bytes):>6.1%} {t.chunks:>8} {t.in_flight:>9}")
    if redis_cluster:
        print(f"redis cluster: state {health['redis']}, {health['primaries']} primaries, {health['replicas']} replicas"
              + (f", failed: {', '.join(health['failed'])}" if health["failed"] else "")
              + (f", no live replica: {', '.join(health['primaries_without_replica'])}"
                 if health["primaries_without_replica"] else ""))
    return 1 if problems else 0


def _add_remote(p) -> None:
    p.add_argument("--addr", default="127.0.0.1:50051", help="daemon address HOST:PORT")
    p.add_argument("--auth-token-file", help="file holding the daemon's bearer token")
    p.add_argument("--tls-ca", help="CA certificate (PEM) to verify a TLS daemon")
    p.add_argument("--tls-cert", help="client certificate chain (PEM), for a daemon that requires one")
    p.add_argument("--tls-key", help="client private key (PEM)")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline in seconds")


def version() -> str:
    """The installed distribution's version (pyproject.toml), for ``--version``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("kvstore")
    except PackageNotFoundError:
        return "unknown (not installed)"


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse like ``parser.parse_args``, except that arguments a subcommand does not know are
    reported with that subcommand's usage, not the top level's."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvstore", description="Multi-tier KV-cache store.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("config", help="print the effective configuration")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--daemon", action="store_true",
                   help="the running daemon's configuration (at --addr), or with --config what `kvstore serve --config` runs with")
    _add_remote(p)
    p.set_defaults(func=cmd_config)
    p = sub.add_parser("fsck", help="verify every blob in the disk tier")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--data-dir", help="disk tier directory (overrides the configuration)")
    p.add_argument("--repair", action="store_true",
                   help="delete corrupt and temporary files (refused while a daemon or Store holds the directory)")
    p.set_defaults(func=cmd_fsck)
    p = sub.add_parser("serve", help="run the daemon (defaults: loopback, host RAM + a local data directory)")
    p.add_argument("--config", help="TOML daemon configuration file (see docs/daemon.md)")
    p.add_argument("--listen", help="HOST:PORT to serve gRPC on (default 127.0.0.1:50051)")
    p.add_argument("--data-dir", help="disk tier directory")
    p.add_argument("--host-bytes", help="host RAM tier capacity, e.g. 8GiB")
    p.add_argument("--disk-bytes", help="disk tier capacity, e.g. 100GiB")
    p.add_argument("--metrics", help="HOST:PORT for the Prometheus endpoint")
    p.add_argument("--auth-token-file", help="require this bearer token on every RPC (one tenant)")
    p.add_argument("--tenants-file", help="TOML file mapping tokens and certificates to tenants (docs/daemon.md)")
    p.add_argument("--tls-cert", help="TLS certificate chain (PEM)")
    p.add_argument("--tls-key", help="TLS private key (PEM)")
    p.add_argument("--tls-client-ca", help="require client certificates signed by this CA (PEM): mutual TLS")
    p.add_argument("--no-shm", action="store_true", help="disable the shared-memory slots")
    p.add_argument("--no-bulk", action="store_true", help="disable the bulk TCP channel")
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("stats", help="print a running daemon's tiers, usage and hit rates")
    _add_remote(p)
    p.add_argument("--watch", type=float, metavar="SECONDS", help="print again every SECONDS, with read/write rates per tier")
    p.add_argument("--count", type=int, help="with --watch: stop after this many samples (default: until Ctrl-C)")
    p.set_defaults(func=cmd_stats)
    p = sub.add_parser("cluster", help="print a cluster's members, shared usage and health (docs/cluster.md)")
    p.add_argument("--config", help="a member's TOML daemon configuration (its [store.shared_index] and [store.cluster])")
    p.add_argument("--url", help="the shared index's Redis URL (overrides the configuration)")
    p.add_argument("--key-prefix", help="the shared index's key prefix (overrides the configuration)")
    p.add_argument("--redis-cluster", action="store_true", help="the URL names a Redis Cluster node")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=cmd_cluster)
    p = sub.add_parser("ping", help="check that a daemon is serving")
    _add_remote(p)
    p.set_defaults(func=cmd_ping)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)
    try:
        return args.func(args)
    except (ConfigError, UsageError, OSError, ValueError) as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except _unreachable_errors() as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _unreachable_errors() -> tuple[type[BaseException], ...]:
    """Errors talking to, or starting, a daemon that are the user's to fix (wrong address or
    token; a data directory another daemon holds). A daemon's ``StartupError`` only once
    ``serve`` has loaded the daemon: a client command's error must not import it (and torch
    with it, seconds before the one line is printed)."""
    from kvstore.client import DaemonError
    from tiers.base import TierError

    server = sys.modules.get("kvstore.daemon.server")
    return (DaemonError, TierError) + ((server.StartupError,) if server else ())


if __name__ == "__main__":
    sys.exit(main())
