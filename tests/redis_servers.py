"""Real Redis servers for tests (bench/redis_local.py starts them): a standalone server, a
3-node Redis Cluster, and a Redis Cluster of 3 primaries each with a replica (for
failovers), each started by the test session on free loopback ports in temporary
directories and killed at the end. Tests that need them skip, with the reason, when
redis-server is not installed.

tests/conftest.py registers this module as a plugin, so its fixtures are available to
every test module and the session-scoped servers start once per session.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from bench.redis_local import REDIS_CLI, REDIS_SERVER, RedisServer, primary_of, role, start_cluster, wait_until

__all__ = ["RedisServer", "primary_of", "role", "start_cluster", "wait_until"]


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
