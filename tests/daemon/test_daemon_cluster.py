"""Daemon processes as one cluster (docs/cluster.md): each with its own host RAM and local
disk, sharing a PFS directory and a real Redis Cluster of 3 primaries with a replica each
(the Redis tier, the shared index and the ledger). Restarts, kill -9, joins and a Redis
failover, with the shared budgets checked against what the media really hold."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from redis.cluster import RedisCluster  # noqa: E402

from kvstore.client import Client  # noqa: E402
from kvstore.daemon.spawn import DaemonProcess  # noqa: E402
from kvstore.keys import Namespace, chunk_keys  # noqa: E402
from redis_servers import primary_of, role, wait_until  # noqa: E402
from tiers.files import SUFFIX, round_up  # noqa: E402

CLUSTER_NS = Namespace("cluster-daemons", num_layers=2, num_kv_heads=2, head_dim=32, chunk_tokens=32)
BLOB = CLUSTER_NS.chunk_bytes + 128  # one chunk's blob: its header and raw payload
PFS_BUDGET = 40 * round_up(BLOB)
REDIS_BUDGET = 40 * BLOB


def member_toml(tmp_path, name, url, heartbeat_s=0.2, member_ttl_s=1.0) -> str:
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
listen = "127.0.0.1:0"
[shm]
slots = 8
slot_bytes = "1MiB"
[store.host]
capacity_bytes = "16MiB"
page_bytes = 4096
[store.disk]
path = "{tmp_path / name / 'disk'}"
capacity_bytes = "64MiB"
[store.pfs]
enabled = true
path = "{tmp_path / 'pfs'}"
capacity_bytes = {PFS_BUDGET}
[store.redis]
enabled = true
cluster = true
url = "{url}"
key_prefix = "c:v:"
capacity_bytes = {REDIS_BUDGET}
reconnect_s = 0.2
[store.shared_index]
enabled = true
cluster = true
url = "{url}"
key_prefix = "c:i:"
reconnect_s = 0.2
[store.cluster]
enabled = true
member = "{name}"
heartbeat_s = {heartbeat_s}
member_ttl_s = {member_ttl_s}
""")
    return str(path)


def chunks(n, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 9999, (n * CLUSTER_NS.chunk_tokens,), generator=gen).tolist(), CLUSTER_NS)
    return keys, [torch.randn(CLUSTER_NS.chunk_shape, generator=gen).half() for _ in keys]


def put(daemon, keys, values):
    with Client(daemon.addr, transport="remote") as c:
        for k, v in zip(keys, values):
            c.put(k, v, durable=True)


def read_back(daemon, keys, values) -> int:
    """How many leading chunks the daemon looks up and returns with the right bytes."""
    with Client(daemon.addr, transport="remote") as c:
        n = c.lookup(keys)
        got = c.get(keys[:n])
    assert all(torch.equal(x, y) for x, y in zip(got, values))
    return len(got)


def pfs_files(tmp_path) -> dict[str, int]:
    out = {}
    for d, _, files in os.walk(tmp_path / "pfs"):
        for f in files:
            if f.endswith(SUFFIX):
                out[f[: -len(SUFFIX)]] = round_up(os.path.getsize(os.path.join(d, f)))
    return out


def redis_values(servers) -> int:
    """Bytes of the Redis tier's values on the Redis Cluster, every primary."""
    client = RedisCluster.from_url(servers[0].url)
    try:
        keys = list(client.scan_iter(match="c:v:*", count=1000, target_nodes=RedisCluster.PRIMARIES))
        return sum(client.strlen(k) for k in keys)
    finally:
        client.close()


def cluster_cli(config: str) -> tuple[int, dict]:
    run = subprocess.run([sys.executable, "-m", "kvstore", "cluster", "--config", config, "--json"],
                         capture_output=True, text=True, timeout=30)
    assert run.returncode in (0, 1), run.stderr
    return run.returncode, json.loads(run.stdout)


def assert_within_budgets(tmp_path, servers, config):
    code, report = cluster_cli(config)
    files = pfs_files(tmp_path)
    assert sum(files.values()) <= PFS_BUDGET and report["tiers"]["pfs"]["used_bytes"] == sum(files.values())
    assert redis_values(servers) <= REDIS_BUDGET
    return code, report


def test_restart_kill_and_join_lose_no_durable_chunk_and_keep_the_budgets(tmp_path, redis_cluster_with_replicas):
    servers = redis_cluster_with_replicas
    ka, va = chunks(10, 1)
    kb, vb = chunks(10, 2)
    kc, vc = chunks(40, 3)
    kd, vd = chunks(40, 4)
    url = servers[0].url
    a_toml, b_toml = member_toml(tmp_path, "a", url), member_toml(tmp_path, "b", url)
    a, b = DaemonProcess(["--config", a_toml]), DaemonProcess(["--config", b_toml])
    c = None
    try:
        put(a, ka, va)
        put(b, kb, vb)
        # a rolling restart of a: b keeps serving a's chunks meanwhile; a comes back with all
        assert a.stop() == 0
        assert read_back(b, ka, va) == 10
        a = DaemonProcess(["--config", a_toml])
        assert read_back(a, ka + kb, va + vb) == 20
        # b's pins hold on the shared tiers while a writes twice their budget's worth
        with Client(b.addr, transport="remote") as cb:
            assert cb.pin(kb, 300) == 10
        put(a, kc, vc)
        files = pfs_files(tmp_path)
        assert all(k.id.hex() in files for k in kb)
        assert_within_budgets(tmp_path, servers, a_toml)
        # kill -9 b: every chunk it acknowledged as durable is served by a
        b.kill()
        assert read_back(a, kb, vb) == 10
        # b is dead within member_ttl_s: its pins end, and its chunks go first
        wait_until(lambda: next(m for m in cluster_cli(a_toml)[1]["members"] if m["name"] == "b")["live"] is False,
                   10, "b never counted as dead")
        put(a, kd, vd)
        files = pfs_files(tmp_path)
        assert not any(k.id.hex() in files for k in kb)
        code, report = assert_within_budgets(tmp_path, servers, a_toml)
        assert code == 0 and report["health"]["ok"] and report["health"]["primaries"] == 3
        members = {m["name"]: m for m in report["members"]}
        assert members["a"]["live"] and members["a"]["heartbeat_age_s"] < 1.0 and members["b"]["pins"] == 0
        assert members["a"]["info"]["addr"] == a.addr and members["b"]["info"]["addr"] == b.addr
        # a daemon that joins finds what the cluster has
        c = DaemonProcess(["--config", member_toml(tmp_path, "c", url)])
        assert read_back(c, kd, vd) == 40
        # b restarted: its local disk still has every chunk it acknowledged
        b = DaemonProcess(["--config", b_toml])
        with Client(b.addr, transport="remote") as cb:
            assert cb.lookup(kb) == 10
            assert cb.stats().tiers["disk"].chunks == 10
        assert read_back(b, kb, vb) == 10
    finally:
        for d in (a, b, c):
            if d is not None:
                d.kill()


def wait_replicated(servers) -> None:
    """Every replica has every write its primary had taken when this was called (before a
    primary is killed). The daemons' heartbeats go on writing meanwhile, so a replica need never
    be level with its primary at the instant both are asked: waiting for that failed under load."""
    def replication(s) -> dict[str, str]:
        return dict(line.strip().split(":", 1) for line in s.cli("INFO", "replication").splitlines() if ":" in line)

    taken = {s.port: int(replication(s)["master_repl_offset"]) for s in servers if s.proc and role(s) == "master"}
    replicas = [s for s in servers if s.proc and role(s) == "slave"]

    def done():
        for s in replicas:
            info = replication(s)
            if int(info.get("slave_repl_offset", -1)) < taken.get(int(info.get("master_port", -1)), float("inf")):
                return False
        return True

    wait_until(done, 10, "replicas did not catch up")


def test_a_redis_cluster_failover_leaves_the_daemons_serving(tmp_path, redis_cluster_with_replicas):
    servers = redis_cluster_with_replicas
    ka, va = chunks(10, 5)
    kb, vb = chunks(10, 6)
    kc, vc = chunks(50, 7)
    ledger_primary = primary_of(servers, "{c:i:cluster}:tag")
    url = next(s.url for s in servers if s is not ledger_primary)  # where daemons and the CLI connect
    # members outlive the failover (under load it took 1.8 s, past the 1 s default here, and a
    # member whose lease lapses is rightly taken for dead, its pins with it)
    a_toml = member_toml(tmp_path, "a", url, member_ttl_s=10.0)
    a, b = DaemonProcess(["--config", a_toml]), DaemonProcess(["--config", member_toml(tmp_path, "b", url, member_ttl_s=10.0)])
    try:
        put(a, ka, va)
        with Client(a.addr, transport="remote") as ca:
            assert ca.pin(ka, 300) == 10
        before = cluster_cli(a_toml)[1]["tiers"]
        wait_replicated(servers)
        ledger_primary.stop()  # the primary holding the ledger: budgets, usage, heartbeats, pins
        started = time.monotonic()

        def serving():
            try:
                put(b, kb, vb)
                return read_back(b, ka, va) == 10
            except Exception:
                return False

        wait_until(serving, 15, "the daemons did not serve durable puts again after the failover")
        print(f"durable puts served again {time.monotonic() - started:.1f} s after the primary was killed")
        code, report = cluster_cli(a_toml)
        assert code == 1 and report["health"]["failed"] == [f"127.0.0.1:{ledger_primary.port}"]
        assert report["health"]["primaries"] == 3 and report["health"]["primaries_without_replica"]
        after = report["tiers"]
        assert after["pfs"]["budget_bytes"] == before["pfs"]["budget_bytes"] == PFS_BUDGET
        assert after["pfs"]["used_bytes"] >= before["pfs"]["used_bytes"]  # nothing the replica lost
        assert {m["name"] for m in report["members"] if m["live"]} == {"a", "b"}
        # the pins of a survived the failover: b writes past the budget, a's chunks stay
        put(b, kc, vc)
        files = pfs_files(tmp_path)
        assert all(k.id.hex() in files for k in ka)
        assert_within_budgets(tmp_path, servers, a_toml)
        # the old primary comes back as a replica: healthy again
        ledger_primary.start()
        wait_until(lambda: cluster_cli(a_toml)[0] == 0, 15, "the cluster did not report healthy again")
        assert role(ledger_primary) == "slave"
    finally:
        a.kill()
        b.kill()
