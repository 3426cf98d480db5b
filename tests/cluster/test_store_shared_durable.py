"""Durable puts through a shared remote tier (Redis), alone and as cluster members
(kvstore/cluster/budgeted_tier.py, kvstore/cluster/ledger.py): a durable put returns only once its chunk is
on the tier, whatever removed the value behind this index's back meanwhile. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import HeldAfterDelete, HeldAfterWrite, HeldBeforeDelete, watch_ledger  # noqa: E402
from faults import Call, FaultyTier, Gate, wait_until  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, daemon_config, one_chunk_cluster, redis_member  # noqa: E402

def durable_put_beside_a_held_delete(b, key, value, gate, deleting) -> None:
    """B's durable put of the chunk while a delete is held at ``gate``: the delete goes on once
    B's copy has asked the ledger (and was told busy) or B's put has ended; both end here."""
    seen = watch_ledger(b)
    putting = Call(lambda: b.put(key, value, durable=True))
    wait_until(lambda: seen.busy.is_set() or putting.finished.is_set(), what="b's copy to ask the ledger")
    gate.open()  # the delete removes the value: b's, if b was let write it
    deleting.outcome()
    putting.outcome()


def test_a_durable_re_put_after_the_ledger_evicted_its_redis_copy_writes_it_again(tmp_path, redis_server):
    """The ledger has this member evict a value; the shared index forgets it, this index still
    lists its copy as current and synced. Before the fix a durable re-put trusted that copy
    and returned with nothing on Redis: after a restart the chunk was gone."""
    keys, values = chunks(3, seed=7)
    cfg = redis_member(tmp_path, redis_server.url, "rv-ledger")
    cfg.redis.capacity_bytes = 2 * BLOB  # the cluster's budget: two chunks
    raw = redis.Redis.from_url(redis_server.url)
    rkey = lambda k: cfg.redis.key_prefix.encode() + k.id.hex().encode()  # noqa: E731
    with Store(cfg) as a:
        for k, v in zip(keys, values):
            a.put(k, v, durable=True)  # the third makes the ledger evict the first from Redis
        assert not raw.exists(rkey(keys[0])), "the ledger evicted the oldest chunk from Redis"
        a.put(keys[0], values[0], durable=True)  # acknowledged: "written and synced on every replica tier"
        on_redis = raw.exists(rkey(keys[0]))
    with Store(cfg) as a:  # a restart: what was durable is there
        found = a.lookup(keys[:1])
    assert (on_redis, found) == (1, 1), "a durable put returned with no copy of the chunk on the Redis tier"


def test_a_durable_re_put_after_redis_evicted_the_value_writes_it_again(tmp_path, redis_server):
    """Redis may evict a value on its own (maxmemory): the index learns of it only on a read.
    Before the fix a durable re-put of the chunk trusted the listed copy and wrote nothing."""
    keys, values = chunks(1, seed=12)
    cfg = daemon_config(tmp_path, "solo", redis_server.url, True, "rv-maxmem", pfs=False)
    cfg.disk.enabled = False
    raw = redis.Redis.from_url(redis_server.url)
    rkey = cfg.redis.key_prefix.encode() + keys[0].id.hex().encode()
    with Store(cfg) as s:
        s.put(keys[0], values[0], durable=True)
        raw.delete(rkey)  # what a maxmemory policy does to a value: the tier's docstring allows it
        s.put(keys[0], values[0], durable=True)  # "written and synced on every replica tier"
        on_redis = raw.exists(rkey)
    assert on_redis, "a durable put returned with no copy on Redis: the index trusted a value Redis evicted"


def test_a_durable_put_that_starts_after_a_members_delete_removed_the_value_keeps_a_copy(tmp_path, redis_server):
    """Member A's delete has removed the value and not yet released its ledger entry when B's
    durable put of the chunk starts. Before the fix the ledger answered B's reservation
    "present", B wrote nothing and was acknowledged, and A's release then dropped the entry:
    the chunk was on no tier but B's host RAM."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-present", 11)
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)
        gate = Gate(key.id)
        budgeted = a.tier("redis")
        budgeted.inner = HeldAfterDelete(budgeted.inner, gate)
        seen = watch_ledger(b)
        deleting = Call(lambda: a.delete([key]))
        assert gate.entered.wait(10)
        assert not raw.exists(rkey)  # a's delete removed the value; its ledger entry is released next
        putting = Call(lambda: b.put(key, value, durable=True))  # starts after the value is gone
        # before the fix it was acknowledged at once, with nothing written; now its copy waits
        # (the entry is busy) until a's delete is done, then writes the value. Waited for as a
        # condition: the fixed wait of a second this had let a loaded machine open the gate
        # before b's copy asked the ledger at all, racing a's delete instead.
        wait_until(lambda: seen.busy.is_set() or putting.finished.is_set(), what="b's copy to ask the ledger")
        assert not putting.finished.is_set(), "b's durable put was acknowledged while a's delete held the entry"
        gate.open()
        deleting.outcome()
        putting.outcome()
        on_redis = raw.exists(rkey)
    with Store(cb) as b:  # b restarts: what was durable is there
        found = b.lookup([key])
    assert (on_redis, found) == (1, 1), "b's durable put, acknowledged after a's delete removed the value, has no copy"


def test_a_durable_put_granted_right_after_a_members_delete_dropped_the_entry_keeps_its_entry_and_index(
        tmp_path, redis_server):
    """A's delete has told the ledger its value is gone (the entry dropped) and has not
    returned when B's durable put of the chunk reserves, writes, commits and is acknowledged.
    Before the fix A's delete then released the key's entry whatever it was by then (B's,
    resident: its value on Redis uncounted by the budget), and removed the chunk from the
    shared index after B had added it: after a restart B's durable put was found nowhere."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-granted", 17)
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)
        gate = Gate(key.id)
        watch_ledger(a, after_evicted=gate)
        deleting = Call(lambda: a.delete([key]))
        assert gate.entered.wait(10)
        assert not raw.exists(rkey)
        b.put(key, value, durable=True)  # acknowledged: on Redis, synced
        gate.open()
        assert deleting.outcome() == 1
        holder = b.tier("redis").ledger.holder("redis", key.id)
        on_redis = raw.exists(rkey)
    with Store(cb) as b:  # b restarts: what was durable is there
        found = b.lookup([key])
    assert (on_redis, holder, found) == (1, ("r", "b"), 1), \
        "b's durable put, granted after a's delete dropped the entry, lost its ledger entry or its index entry"


def test_a_delete_of_a_value_another_members_delete_holds_leaves_that_entry_to_it(tmp_path, redis_server):
    """A's delete has taken the key's entry and not yet removed the value when C deletes the
    chunk too. Before the fix C's delete dropped A's entry: B's durable put was then granted,
    written and acknowledged, and A's delete removed its value."""
    key, value, (ca, cb, cc), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-two-deletes", 19, "abc")
    with Store(ca) as a, Store(cb) as b, Store(cc) as c:
        a.put(key, value, durable=True)
        assert c.lookup([key]) == 1  # c finds it through the shared index
        gate = Gate(key.id)
        budgeted = a.tier("redis")
        budgeted.inner = HeldBeforeDelete(budgeted.inner, gate)
        deleting = Call(lambda: a.delete([key]))
        assert gate.entered.wait(10)  # a holds the entry (evicting); the value is still there
        assert c.delete([key]) == 1
        durable_put_beside_a_held_delete(b, key, value, gate, deleting)
        on_redis = raw.exists(rkey)
    with Store(cb) as b:
        found = b.lookup([key])
    assert (on_redis, found) == (1, 1), "b's durable put, acknowledged, lost its copy to a's delete"


def test_a_write_pending_when_a_members_delete_starts_is_not_acknowledged_without_its_value(tmp_path, redis_server):
    """B's copy of a durable put has reserved the key and written the value, not committed it,
    when A deletes the chunk. Before the fix A's delete left the pending entry alone until
    it released it after its DEL: B's commit in between succeeded, and B's durable put was
    acknowledged with its value deleted. Now the delete takes the entry: B's commit fails,
    and so does its put."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-pending", 23)
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)
        raw.delete(rkey)  # Redis drops it on its own: b's copy takes the entry over and writes
        written, deleted = Gate(key.id), Gate(key.id)
        b.tier("redis").inner = HeldAfterWrite(b.tier("redis").inner, written)
        a.tier("redis").inner = HeldAfterDelete(a.tier("redis").inner, deleted)
        putting = Call(lambda: b.put(key, value, durable=True))
        assert written.entered.wait(10)  # b's value is in place, its entry pending
        deleting = Call(lambda: a.delete([key]))
        assert deleted.entered.wait(10)  # a's DEL removed b's value
        written.open()  # b commits
        assert putting.finished.wait(30)
        deleted.open()
        deleting.outcome()
        acknowledged = putting.error is None
        on_redis = raw.exists(rkey)
    with Store(cb) as b:
        found = b.lookup([key])
    assert not acknowledged or (on_redis, found) == (1, 1), \
        "b's durable put was acknowledged though a's delete removed its value"


def test_a_delete_of_a_value_the_ledger_lost_holds_the_key_until_the_value_is_gone(tmp_path, redis_server):
    """The ledger has no entry for A's value (a failover lost its last updates: docs/cluster.md)
    when A deletes it. Before the fix A's delete took nothing: B's durable put was granted,
    written and acknowledged before A's DEL, which then removed its value."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-lost-entry", 29)
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)
        a.cluster.ledger.release("a", "redis", [key.id])  # the entry is lost; the value stays
        gate = Gate(key.id)
        budgeted = a.tier("redis")
        budgeted.inner = HeldBeforeDelete(budgeted.inner, gate)
        deleting = Call(lambda: a.delete([key]))
        assert gate.entered.wait(10)  # a's delete began; its DEL is next
        durable_put_beside_a_held_delete(b, key, value, gate, deleting)
        on_redis = raw.exists(rkey)
    with Store(cb) as b:
        found = b.lookup([key])
    assert (on_redis, found) == (1, 1), "b's durable put, acknowledged, lost its copy to a's delete"


def test_a_failed_copy_of_a_re_put_leaves_the_durable_older_value_on_redis(tmp_path, redis_server):
    """A cluster member's copy of a re-put (another codec) to Redis fails before it lands.
    Before the fix BudgetedTier._undo deleted the key: the older, whole value of the chunk,
    a durable put's."""
    keys, values = chunks(1, seed=13)
    cfg = daemon_config(tmp_path, "a", redis_server.url, True, "rv-undo", pfs=False)
    cfg.disk.enabled = False
    cfg.cluster.enabled = True
    cfg.cluster.member = "a"
    raw = redis.Redis.from_url(redis_server.url)
    rkey = cfg.redis.key_prefix.encode() + keys[0].id.hex().encode()
    with Store(cfg) as a:
        a.put(keys[0], values[0], durable=True)  # raw codec: on Redis, synced
        before = raw.get(rkey)
        budgeted = a.tier("redis")
        faulty = budgeted.inner = FaultyTier(budgeted.inner)
        faulty.failures["write"] = 1  # the re-put's copy fails (a timeout, Redis down for a moment)
        a.put(keys[0], values[0], codec="int8")  # another blob of the chunk, not durable
        a.flush()
        after = raw.get(rkey)
        assert budgeted.used_bytes >= len(before)  # the older value counts against the budget again
    with Store(cfg) as a:  # a restart: the durable put's value is what Redis holds
        found = len(a.get(keys))  # the lookup index still lists it; the read tells
    assert before is not None
    assert (after is not None, after == before, found) == (True, True, 1), "the durable put's value was deleted by the undo of a failed re-put"
