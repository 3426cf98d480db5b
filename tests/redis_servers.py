"""Real Redis servers for tests: a standalone server, a 3-node Redis Cluster, and a Redis
Cluster of 3 primaries each with a replica (for failovers), each started by the test
session on free loopback ports in temporary directories and killed at the end. Tests that need them skip, with the reason, when redis-server is not installed.

tests/conftest.py registers this module as a plugin, so its fixtures are available to
every test module and the session-scoped servers start once per session.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

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
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(self.node_timeout_ms)]
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


def _require_redis() -> None:
    if REDIS_SERVER is None or REDIS_CLI is None:
        pytest.skip("redis-server/redis-cli not installed (.ci/run installs Debian's redis-server)")


def _stop_all(servers: list[RedisServer]) -> None:
    for s in servers:
        s.stop()
    shutil.rmtree(servers[0].workdir.parent, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_server():
    """A standalone server shared by the session (tests use distinct key prefixes)."""
    _require_redis()
    servers = [RedisServer(Path(tempfile.mkdtemp(prefix="redis-")) / "server").start()]
    try:
        yield servers[0]
    finally:
        _stop_all(servers)


@pytest.fixture
def own_redis_server(tmp_path):
    """A standalone server for one test (kill/restart, memory limits)."""
    _require_redis()
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    """A 3-primary Redis Cluster shared by the session; yields the node servers."""
    _require_redis()
    servers = start_cluster(Path(tempfile.mkdtemp(prefix="redis-cluster-")))
    try:
        yield servers
    finally:
        _stop_all(servers)


@pytest.fixture
def redis_cluster_with_replicas(tmp_path):
    """3 primaries with one replica each, for one test (a primary is killed: a failover);
    node timeout 500 ms, so a replica takes over within about two seconds."""
    _require_redis()
    servers = start_cluster(tmp_path / "cluster", replicas=1, node_timeout_ms=500)
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()


@pytest.fixture
def own_redis_cluster(tmp_path):
    """A 3-primary Redis Cluster for one test (nodes killed and restarted)."""
    _require_redis()
    servers = start_cluster(tmp_path / "cluster")
    try:
        yield servers
    finally:
        for s in servers:
            s.stop()
