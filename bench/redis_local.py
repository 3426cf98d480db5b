"""Real Redis servers on this machine, for benchmarks and tests: a standalone
``redis-server``, or a Redis Cluster made with ``redis-cli --cluster create``, on free
loopback ports found at run time, in directories the caller owns. Debian's redis-server
package provides both binaries.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(cluster: bool = False) -> int:
    """A free loopback port; for cluster nodes the bus port (port + 10000) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not cluster or (port + 10000 < 65536 and _port_is_free(port + 10000)):
            return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    """One redis-server process; ``stop`` kills it, ``start`` brings it back on the same port."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False, args: tuple[str, ...] = (),
                 node_timeout_ms: int = 5000):
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.node_timeout_ms = node_timeout_ms
        self.port = port or free_port(cluster)
        self.args = args
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        cmd = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
               "--save", "", "--appendonly", "no", "--protected-mode", "no", *self.args]
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms),
                    # a primary has one replica at most here: sync it at once, not after the
                    # 5 s Redis waits by default for more replicas to share the transfer
                    "--repl-diskless-sync-delay", "0"]
        log = open(self.workdir / "server.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 10
        while self.cli("PING", check=False).strip() != "PONG":
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start: see {self.workdir}/server.log")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def cli(self, *args: str, check: bool = True) -> str:
        result = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *args],
                                capture_output=True, text=True, timeout=10)
        if check and result.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {result.stderr.strip()}")
        return result.stdout


def start_cluster(workdir: Path, nodes: int = 3, replicas: int = 0, node_timeout_ms: int = 5000) -> list[RedisServer]:
    """``nodes`` primaries with ``replicas`` replicas each, all 16384 slots assigned, the
    cluster state ok and every replica in sync with its primary. A short node timeout makes
    a failover (a replica promoted once its primary is gone) take about two timeouts."""
    servers = []
    try:
        for i in range(nodes * (1 + replicas)):
            servers.append(RedisServer(workdir / f"node{i}", cluster=True, node_timeout_ms=node_timeout_ms).start())
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in servers],
                        "--cluster-replicas", str(replicas), "--cluster-yes"], check=True, capture_output=True, timeout=30)
        wait_until(lambda: all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in servers), 20,
                   "cluster did not reach state ok")
        wait_until(lambda: all("master_link_status:up" in s.cli("INFO", "replication")
                               for s in servers if role(s) == "slave"), 20, "replicas did not sync")
    except BaseException:
        for s in servers:
            s.stop()
        raise
    return servers


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(what)
        time.sleep(0.05)


def role(server: RedisServer) -> str:
    """``master`` or ``slave``, as the server says now."""
    for line in server.cli("INFO", "replication").splitlines():
        if line.startswith("role:"):
            return line.split(":", 1)[1].strip()
    raise RuntimeError(f"redis on port {server.port} reports no role")


def primary_of(servers: list[RedisServer], key: str) -> RedisServer:
    """The live primary that serves ``key``'s slot now."""
    slot = int(servers[0].cli("CLUSTER", "KEYSLOT", key).strip())
    for s in servers:
        if s.proc is None:
            continue
        if role(s) != "master":
            continue
        for line in s.cli("CLUSTER", "NODES").splitlines():
            fields = line.split()
            if "myself" in fields[2]:
                for span in fields[8:]:
                    lo, _, hi = span.partition("-")
                    if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                        return s
    raise RuntimeError(f"no live primary serves slot {slot}")
