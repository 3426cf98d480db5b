"""The store over shared tiers (PFS directory, Redis) as several daemons would use them."""

import logging
import time

import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from faults import Call, Gate  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, daemon_config  # noqa: E402
from tiers.base import TierError, TierUnavailable  # noqa: E402


@pytest.mark.parametrize("shared_index", [True, False])
def test_chunk_put_through_one_daemon_is_found_and_read_through_another(tmp_path, redis_server, shared_index):
    prefix = f"two-{shared_index}"
    keys, values = chunks(5)
    with Store(daemon_config(tmp_path, "a", redis_server.url, shared_index, prefix)) as a, \
            Store(daemon_config(tmp_path, "b", redis_server.url, shared_index, prefix)) as b:
        for k, v in zip(keys, values):
            a.put(k, v, durable=True)
        a.flush()
        assert a.replicas(keys) == [frozenset({"host", "disk", "pfs", "redis"})] * 5
        assert b.lookup(keys) == 5  # a durable put is in the shared index when it returns
        assert b.replicas(keys) == [frozenset({"pfs", "redis"})] * 5
        got = b.get(keys)
        assert len(got) == 5 and all(torch.equal(x, y) for x, y in zip(got, values))
        assert b.stats().tiers["disk"].hits == 0


def test_a_restarted_store_reads_its_chunks_from_every_replica_again(tmp_path, redis_server):
    """After a restart, the shared copies of the chunks the local disk recovered are known
    too: reads fetch from the disk, the PFS and Redis at once, not from the disk alone."""
    keys, values = chunks(4)
    cfg = daemon_config(tmp_path, "a", redis_server.url, True, "restarted")
    with Store(cfg) as a:
        for k, v in zip(keys, values):
            a.put(k, v, durable=True)
    with Store(cfg) as a:
        assert a.replicas(keys) == [frozenset({"disk", "pfs", "redis"})] * 4
        assert all(torch.equal(x, y) for x, y in zip(a.get(keys), values))


def test_delete_on_one_daemon_is_a_clean_miss_on_the_other(tmp_path, redis_server):
    keys, values = chunks(2, seed=1)
    b_config = daemon_config(tmp_path, "b", redis_server.url, True, "del")
    b_config.promote_on_read = False  # b keeps no private copy in its host RAM
    with Store(daemon_config(tmp_path, "a", redis_server.url, True, "del")) as a, Store(b_config) as b:
        for k, v in zip(keys, values):
            a.put(k, v, durable=True)
        assert len(b.get(keys)) == 2
        a.delete(keys[1:])
        got = b.get(keys)  # b still had both in its index: the vanished copies are a clean miss
        assert len(got) == 1 and torch.equal(got[0], values[0])


def test_redis_down_at_start_then_back(tmp_path, own_redis_server):
    own_redis_server.stop()
    keys, values = chunks(3, seed=2)
    cfg = daemon_config(tmp_path, "a", own_redis_server.url, True, "late", pfs=False)
    with Store(cfg) as store:
        store.put(keys[0], values[0])
        store.flush()
        assert store.stats().tiers["redis"].errors >= 1
        assert len(store.get(keys[:1])) == 1
        own_redis_server.start()
        time.sleep(0.3)
        store.put(keys[1], values[1], durable=True)
        assert "redis" in store.replicas(keys[1:2])[0]


NO_PING = ("--user", "noping", "on", ">pw", "~*", "+@all", "-ping")  # a server's user whose ACL lacks PING


def no_ping_url(server) -> str:
    return f"redis://noping:pw@127.0.0.1:{server.port}/0"


def test_redis_refusing_the_client_at_start_is_one_clear_error(tmp_path, own_redis_server):
    """The connect's NoPermissionError escaped raw from the Store (a traceback from ``kvstore serve``)."""
    own_redis_server.stop()
    own_redis_server.args = NO_PING
    own_redis_server.start()
    with pytest.raises(TierError, match=r"^redis: Redis refuses this client .*'ping'"):
        Store(daemon_config(tmp_path, "a", no_ping_url(own_redis_server), True, "refused", pfs=False))


@pytest.mark.parametrize("shared_index", [True, False])
def test_redis_back_but_refusing_the_client_is_that_tier_failing(tmp_path, own_redis_server, shared_index, caplog):
    """Redis down at start, then back refusing us: the connect's NoPermissionError escaped
    from lookups, and failed each copy as a bug ("failed unexpectedly")."""
    own_redis_server.stop()
    own_redis_server.args = NO_PING
    keys, values = chunks(3, seed=4)
    cfg = daemon_config(tmp_path, "a", no_ping_url(own_redis_server), shared_index, "refused", pfs=False)
    cfg.redis.reconnect_s = cfg.shared_index.reconnect_s = 0  # every call tries again
    with Store(cfg) as store:
        own_redis_server.start()
        caplog.clear()
        assert store.lookup(keys[1:]) == 0
        store.put(keys[0], values[0])
        store.flush()
        with pytest.raises(TierUnavailable, match="redis: not connected"):
            store.put(keys[1], values[1], durable=True)
        got = store.get(keys[:2])
        assert len(got) == 2 and all(torch.equal(x, y) for x, y in zip(got, values))
        assert store.stats().tiers["redis"].errors >= 2
    refusals = [r for r in caplog.records if "no permissions to run the 'ping'" in r.getMessage()]
    assert {r.name for r in refusals} == {"tiers.reconnecting"} | ({"kvstore.store.tier_setup"} if shared_index else set())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no "failed unexpectedly"


def test_redis_killed_mid_read_is_invisible_to_the_caller(tmp_path, own_redis_server):
    keys, values = chunks(8, seed=3)
    cfg = daemon_config(tmp_path, "a", own_redis_server.url, False, "kill")
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        store.drop(keys, "host")
        stream = store.stream(keys)
        first = next(stream)
        own_redis_server.stop()
        got = [first] + list(stream)
        assert len(got) == 8 and all(torch.equal(x, y) for x, y in zip(got, values))
        store.delete(keys)  # Redis still down: deletes elsewhere go on
        assert store.lookup(keys) == 0


def test_replicate_to_limits_the_copies(tmp_path):
    cfg = daemon_config(tmp_path, "a")
    cfg.replicate_to = ["pfs"]
    keys, values = chunks(2, seed=4)
    with Store(cfg) as store:
        for k, v in zip(keys, values):
            store.put(k, v, durable=True)
        assert store.replicas(keys) == [frozenset({"host", "pfs"})] * 2
    cfg.replicate_to = ["tape"]
    with pytest.raises(ValueError, match="unknown tiers"):
        Store(cfg)


def test_two_daemons_share_chunks_through_a_redis_cluster(tmp_path, redis_cluster):
    url = redis_cluster[0].url
    keys, values = chunks(6, seed=5)
    configs = []
    for name in ("a", "b"):
        cfg = daemon_config(tmp_path, name, url, True, "cl", pfs=False)
        cfg.redis.cluster = cfg.shared_index.cluster = True
        configs.append(cfg)
    with Store(configs[0]) as a, Store(configs[1]) as b:
        for k, v in zip(keys, values):
            a.put(k, v, durable=True)
        assert b.replicas(keys) == [frozenset({"redis"})] * 6
        got = b.get(keys)
        assert len(got) == 6 and all(torch.equal(x, y) for x, y in zip(got, values))


def test_20_a_stale_shared_index_removal_never_erases_a_fresh_entry(tmp_path, redis_server, monkeypatch):
    """A copy dropped from the PFS tier is removed from the shared index while the chunk is
    put again: the removal must not land after the re-put's add (the old code applied
    removals later, on a thread of their own, and erased the fresh entry)."""
    from kvstore.store.tier_setup import SharedIndexClient

    keys, values = chunks(1, seed=7)
    gate = Gate(times=1)
    remove = SharedIndexClient.remove

    def held_remove(self, tier_name, key_ids):
        if tier_name == "pfs":
            gate.pass_through(key_ids[0])
        return remove(self, tier_name, key_ids)

    with Store(daemon_config(tmp_path, "a", redis_server.url, True, "stale")) as a:
        a.put(keys[0], values[0], durable=True)
        monkeypatch.setattr(SharedIndexClient, "remove", held_remove)
        drop = Call(lambda: a.drop(keys, "pfs"))
        assert gate.entered.wait(10)  # the dropped copy's removal from the shared index is under way
        reput = Call(lambda: a.put(keys[0], values[0], durable=True))
        reput.finished.wait(0.5)  # the old code's re-put added its entry here, before the removal landed
        gate.open()
        assert drop.outcome() == 1
        reput.outcome()
        with Store(daemon_config(tmp_path, "b", redis_server.url, True, "stale")) as b:
            assert b.lookup(keys) == 1 and "pfs" in b.replicas(keys)[0]
