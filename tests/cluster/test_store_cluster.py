"""Several Stores as members of one cluster (docs/cluster.md): one PFS directory and one
Redis holding the shared index and the ledger, each Store with its own host RAM and local
disk. The shared tier's budget holds for the cluster, pins hold across members, and a
configuration that could not be fair is refused (review #14)."""

import os
import threading
import time

import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.cluster.member import MARKER  # noqa: E402
from kvstore.config import ConfigError, StoreConfig  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, daemon_config  # noqa: E402
from tiers.base import TierError  # noqa: E402
from tiers.files import SUFFIX, round_up  # noqa: E402

FOOTPRINT = 8192  # one test chunk (4224 bytes) on the PFS, rounded up to 4 KiB blocks
BUDGET = 12 * FOOTPRINT


def member(tmp_path, name, redis_url, prefix, budget=BUDGET, **cluster) -> StoreConfig:
    cfg = daemon_config(tmp_path, name, redis_url, True, prefix)
    cfg.redis.enabled = False
    cfg.pfs.capacity_bytes = budget
    cfg.cluster.enabled = True
    cfg.cluster.member = name
    for key, value in cluster.items():
        setattr(cfg.cluster, key, value)
    return cfg


def pfs_files(tmp_path) -> dict[str, int]:
    """Every chunk file on the shared directory: key hex -> footprint."""
    out = {}
    for d, _, files in os.walk(tmp_path / "pfs"):
        for f in files:
            if f.endswith(SUFFIX):
                out[f[: -len(SUFFIX)]] = round_up(os.path.getsize(os.path.join(d, f)))
    return out


def put_all(store, keys, values):
    for k, v in zip(keys, values):
        store.put(k, v, durable=True)


def test_14_the_cluster_keeps_one_budget_for_the_shared_directory(tmp_path, redis_server):
    """Two members with the same budget put more than it holds, one after the other and then
    both at once: the files on the directory never take more than the budget (without the
    cluster each daemon kept its own budget against its own view: twice as much), they are
    exactly what the ledger counts, and each member ends up with about its fair half."""
    keys, values = chunks(80)
    with Store(member(tmp_path, "a", redis_server.url, "budget")) as a, \
            Store(member(tmp_path, "b", redis_server.url, "budget")) as b:
        for store, lo in ((a, 0), (b, 20)):
            for k, v in zip(keys[lo:lo + 20], values[lo:lo + 20]):
                store.put(k, v, durable=True)
                assert sum(pfs_files(tmp_path).values()) <= BUDGET
        threads = [threading.Thread(target=put_all, args=(s, keys[lo:lo + 20], values[lo:lo + 20]))
                   for s, lo in ((a, 40), (b, 60))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        files = pfs_files(tmp_path)
        state = a.cluster.ledger.state(10.0)
        usage = state.tiers["pfs"]
        assert sum(files.values()) <= BUDGET
        assert usage.used_bytes == sum(files.values()) and usage.chunks == len(files) and usage.in_flight == 0
        assert usage.used_bytes == BUDGET  # full: evictions made just the room needed
        assert set(usage.by_member) == {"a", "b"}
        assert all(abs(used - BUDGET // 2) <= 2 * FOOTPRINT for used in usage.by_member.values())
        assert a.tier("pfs").used_bytes <= a.tier("pfs").capacity_bytes == BUDGET


def test_14_a_chunk_one_member_pins_is_never_evicted_by_another(tmp_path, redis_server):
    keys, values = chunks(60)
    pinned, others = keys[:8], keys[8:]
    with Store(member(tmp_path, "a", redis_server.url, "pins")) as a, \
            Store(member(tmp_path, "b", redis_server.url, "pins")) as b:
        put_all(a, keys[:8], values[:8])
        assert a.pin(pinned, 300) == 8
        put_all(b, keys[8:40], values[8:40])  # 32 chunks through the 4 chunks of room left
        files = pfs_files(tmp_path)
        assert all(k.id.hex() in files for k in pinned)
        assert len(files) == 12 and sum(files.values()) <= BUDGET
        assert b.lookup(pinned) == 8 and len(b.get(pinned)) == 8  # read through the PFS
        # the budget full of pinned chunks: a durable put fails rather than going over it
        assert b.pin(keys[36:40], 300) == 4
        with pytest.raises(TierError):
            b.put(others[-1], values[-1], durable=True)
        assert sum(pfs_files(tmp_path).values()) <= BUDGET
        assert a.unpin(pinned) == 8
        put_all(b, keys[40:44], values[40:44])  # now a's chunks can go: a is above its fair half
        files = pfs_files(tmp_path)
        assert all(k.id.hex() in files for k in keys[36:40]) and keys[43].id.hex() in files
        assert sum(k.id.hex() in files for k in pinned) <= 6 and sum(files.values()) <= BUDGET


def test_a_dead_members_pins_end_and_its_unfinished_writes_are_removed(tmp_path, redis_server):
    """A member that stops beating (its process died) stops counting within member_ttl_s:
    its pins no longer keep chunks, and a write it left half done is removed and uncounted."""
    keys, values = chunks(30)
    cfg = member(tmp_path, "a", redis_server.url, "dead", heartbeat_s=0.1, member_ttl_s=0.5)
    with Store(cfg) as a:
        ghost = Ledger(redis_server.url, cfg.shared_index.key_prefix, False)
        try:
            put_all(a, keys[:4], values[:4])
            ghost.join("ghost", {"pfs": BUDGET}, {})
            ghost.pin("ghost", [k.id for k in keys[:4]], 300)
            half = b"\x07" * 32
            assert ghost.reserve("ghost", "pfs", half, FOOTPRINT, 4224, 0.5)[0] == "ok"
            path = a.tier("pfs").path_of(half)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"\0" * 4224)  # renamed into place, never committed: then it died
            assert a.cluster.ledger.state(0.5).tiers["pfs"].used_bytes == 5 * FOOTPRINT
            deadline = time.monotonic() + 10
            while path.exists() or a.cluster.ledger.state(0.5).tiers["pfs"].in_flight:
                assert time.monotonic() < deadline, "the dead member's half-written value stayed"
                time.sleep(0.05)
            assert a.cluster.ledger.state(0.5).tiers["pfs"].used_bytes == 4 * FOOTPRINT
            ghost_state = next(m for m in a.cluster.ledger.state(0.5).members if m.name == "ghost")
            assert not ghost_state.live and ghost_state.pins == 0
            put_all(a, keys[4:30], values[4:30])
            assert not any(k.id.hex() in pfs_files(tmp_path) for k in keys[:4])  # the dead pins kept nothing
        finally:
            ghost.close()


def test_a_member_that_joins_finds_what_the_cluster_has(tmp_path, redis_server):
    keys, values = chunks(6)
    with Store(member(tmp_path, "a", redis_server.url, "join")) as a:
        put_all(a, keys, values)
        with Store(member(tmp_path, "late", redis_server.url, "join")) as late:
            assert late.lookup(keys) == 6
            got = late.get(keys)
            assert all(torch.equal(x, y) for x, y in zip(got, values))
            assert late.stats().tiers["pfs"].hits == 6
            assert {m.name for m in late.cluster.ledger.state(10).members if m.live} == {"a", "late"}


def test_a_member_restarted_owns_its_chunks_again_and_a_clean_leave_drops_its_pins(tmp_path, redis_server):
    keys, values = chunks(4)
    cfg = member(tmp_path, "a", redis_server.url, "restart")
    with Store(cfg) as a:
        put_all(a, keys, values)
        a.pin(keys, 300)
        assert next(m for m in a.cluster.ledger.state(10).members if m.name == "a").pins == 4
    with Store(cfg) as a:
        state = a.cluster.ledger.state(10)
        assert state.tiers["pfs"].by_member == {"a": 4 * FOOTPRINT}
        assert next(m for m in state.members if m.name == "a").pins == 0
        assert a.lookup(keys) == 4


def test_configurations_that_cannot_be_fair_are_refused_in_one_line(tmp_path, redis_server):
    cfg = member(tmp_path, "a", redis_server.url, "refuse")
    cfg.shared_index.enabled = False
    with pytest.raises(ConfigError, match="cluster.enabled: needs shared_index.enabled"):
        Store(cfg)
    cfg = member(tmp_path, "a", redis_server.url, "refuse")
    cfg.pfs.enabled = False
    with pytest.raises(ConfigError, match="no shared tier"):
        Store(cfg)
    with pytest.raises(ConfigError, match="at least 3 heartbeats"):
        Store(member(tmp_path, "a", redis_server.url, "refuse", heartbeat_s=1.0, member_ttl_s=2.0))
    with Store(member(tmp_path, "a", redis_server.url, "refuse")):
        assert (tmp_path / "pfs" / MARKER).read_text().strip() == "refuse:i:"
        with pytest.raises(ConfigError, match=r"pfs.capacity_bytes is 196608 bytes but the cluster's budget for it is 98304"):
            Store(member(tmp_path, "b", redis_server.url, "refuse", budget=2 * BUDGET))
        solo = daemon_config(tmp_path, "solo", redis_server.url, True, "refuse")
        with pytest.raises(ConfigError, match="is shared by the cluster with shared index prefix 'refuse:i:'"):
            Store(solo)  # not a member: it would evict the members' chunks down to its own budget
        with pytest.raises(ConfigError, match="belongs to the cluster with shared index prefix 'refuse:i:'"):
            Store(member(tmp_path, "c", redis_server.url, "other"))


def test_without_a_cluster_nothing_changes(tmp_path, redis_server):
    """The defaults: no cluster, the pfs tier's capacity is this daemon's own budget."""
    assert StoreConfig().cluster.enabled is False
    keys, values = chunks(4)
    with Store(daemon_config(tmp_path, "solo", redis_server.url, False, "solo")) as s:
        put_all(s, keys, values)
        assert s.cluster is None and s.tier("pfs").capacity_bytes == 1 << 22
        assert not (tmp_path / "pfs" / MARKER).exists()


def test_kvstore_cluster_prints_members_usage_and_health(tmp_path, redis_server, capsys):
    from kvstore.cli import main

    keys, values = chunks(20)
    with Store(member(tmp_path, "a", redis_server.url, "cli")) as a, Store(member(tmp_path, "b", redis_server.url, "cli")) as b:
        put_all(a, keys[:10], values[:10])
        a.pin(keys[:3], 300)
        put_all(b, keys[10:], values[10:])
        toml = tmp_path / "member.toml"
        toml.write_text(f'[store.shared_index]\nenabled = true\nurl = "{redis_server.url}"\nkey_prefix = "cli:i:"\n')
        assert main(["cluster", "--config", str(toml)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("(prefix cli:i:): 2 live members, 0 not live; health: ok")
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["a"][1:3] == ["live", "-"] and rows["a"][5] == "3" and rows["b"][5] == "0"  # in-process: no address
    assert rows["pfs"][1:3] == ["96KiB", "96KiB"] and rows["pfs"][4] == "12"
    assert main(["cluster", "--url", "redis://127.0.0.1:1/0"]) == 2
    assert "cannot reach Redis at redis://127.0.0.1:1/0" in capsys.readouterr().err


def test_a_ledger_outage_makes_no_member_dead(tmp_path, own_redis_server):
    """Redis stalls for longer than member_ttl_s (a failover, a restart): every member was
    cut off alike, so when it answers again nobody is reaped for the silence, and a member
    that beats again in time keeps its half-done writes and its pins."""
    import signal

    cfg = member(tmp_path, "a", own_redis_server.url, "outage", heartbeat_s=0.2, member_ttl_s=2.0)
    with Store(cfg) as a:
        other = Ledger(own_redis_server.url, cfg.shared_index.key_prefix, False)
        try:
            other.join("b", {"pfs": BUDGET}, {})
            assert other.reserve("b", "pfs", b"\x05" * 32, FOOTPRINT, 4224, 2.0)[0] == "ok"
            os.kill(own_redis_server.proc.pid, signal.SIGSTOP)
            time.sleep(3.0)  # a's heartbeats queue up meanwhile, and run when Redis resumes
            os.kill(own_redis_server.proc.pid, signal.SIGCONT)
            time.sleep(0.5)
            assert other.beat("b", {}, 2.0, 3600.0) == []
            state = a.cluster.ledger.state(2.0)
            assert state.tiers["pfs"].in_flight == 1 and state.tiers["pfs"].used_bytes == FOOTPRINT
            assert other.commit("b", "pfs", b"\x05" * 32)
        finally:
            other.close()
