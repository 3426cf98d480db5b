"""Deletes and evictions: a value leaves a shared tier by a delete (``deleting.lua``) or as a
victim of ``make_room``; its entry turns evicting, in the deleting member's in-flight set
alone, and ``evicted.lua`` drops it once the value is gone (BudgetedTier.delete, ``remove``).
The unit promises that every such entry is dropped and its bytes uncounted, even where a
step failed for a moment (the medium's delete, the lookup index's ``forget``, the ledger's
``evicted``): the member's heartbeat finishes it; and that no other member is handed an
entry a delete holds. Real Redis; the first tests drive the ledger's scripts one call at a
time, Redis values standing for the medium."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import quick_retrying, settled  # noqa: E402
from faults import FaultyTier, unlisting_fails_once, wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, redis_member  # noqa: E402
from tiers.base import TierError, TierUnavailable  # noqa: E402

TIER = "redis"
BUDGETS = {TIER: 16 * BLOB}
PENDING = b"\x5a" * 32
LOST, HELD = b"\x01" * 32, b"\x02" * 32


@pytest.mark.parametrize("owner_goes", ["reaped", "restarted"])
def test_a_pending_entry_a_delete_takes_is_no_longer_its_writers_to_finish(redis_server, owner_goes):
    """The bug: a delete of w's pending entry left it in w's set too, so two members finished it (fixed in 14521c0)."""
    prefix = "deleting-pending-" + owner_goes + ":"
    raw = redis.Redis.from_url(redis_server.url)
    value = ("value:" + prefix).encode()
    ledger = Ledger(redis_server.url, prefix, False)
    try:
        for m in "wdrx":
            ledger.join(m, BUDGETS, {})
        assert ledger.reserve("w", TIER, PENDING, BLOB, BLOB, 10.0)[0] == "ok"
        raw.set(value, b"w's bytes")  # w's write lands; w does not commit
        ledger.deleting("d", TIER, [PENDING])  # d takes the entry; it deletes the value next
        if owner_goes == "reaped":
            raw.zadd(ledger.prefix + "beats", {"w": 0})  # w stopped beating long ago: it is dead
            finisher, handed = "r", ledger.beat("r", {}, 10.0, 3600.0)
        else:
            finisher, handed = "w", ledger.join("w", BUDGETS, {})
        if (TIER, PENDING) in handed:  # w's unfinished write, as the finisher sees it: delete, then evicted
            raw.delete(value)
            ledger.evicted(finisher, TIER, [PENDING])
        granted = ledger.reserve("x", TIER, PENDING, BLOB, BLOB, 10.0)[0] == "ok"
        acknowledged = False
        if granted:  # x's durable put: write, commit, acknowledged
            raw.set(value, b"x's bytes")
            acknowledged = ledger.commit("x", TIER, PENDING)
        raw.delete(value)  # d's delete goes on: the value under the key goes
        ledger.evicted("d", TIER, [PENDING])
        on_medium = raw.exists(value)
        left = (ledger.holder(TIER, PENDING), ledger.state(10.0).tiers[TIER].in_flight)
    finally:
        ledger.close()
    assert not acknowledged or on_medium, "x's acknowledged durable value was deleted by d's delete"
    assert (TIER, PENDING) not in handed, f"the {owner_goes} writer was handed the entry d's delete holds"
    assert left == (None, 0), "d's delete left an entry, or a key in some member's in-flight set"


def test_evicted_drops_an_entry_of_no_bytes_and_the_entries_after_it(redis_server):
    """The bug: dropping a 0-byte entry gave HINCRBY '-0' and failed the script before later keys (fixed in 39eb546)."""
    ledger = Ledger(redis_server.url, "empty-entry:", False)
    try:
        ledger.join("a", {TIER: 16 * BLOB}, {})
        assert ledger.reserve("a", TIER, HELD, BLOB, BLOB, 10.0)[0] == "ok"
        assert ledger.commit("a", TIER, HELD)
        ledger.deleting("a", TIER, [LOST, HELD])  # LOST has no entry: it gets one of 0 bytes
        used = ledger.evicted("a", TIER, [LOST, HELD])  # both values are gone
        left = (ledger.holder(TIER, LOST), ledger.holder(TIER, HELD), ledger.state(10.0).tiers[TIER].in_flight)
    finally:
        ledger.close()
    assert (used, left) == (0, (None, None, 0)), "evicted left an entry, or a key in the member's in-flight set"


def test_a_delete_the_medium_refused_once_is_finished_and_the_chunk_can_be_put_again(tmp_path, redis_server):
    """The bug: a delete the medium refused left its entry evicting and the chunk busy for good (fixed in 0320d8c)."""
    keys, values = chunks(1, seed=51)
    key, value = keys[0], values[0]
    ca = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-stuck", "a"))
    cb = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-stuck", "b"))
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + key.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)
        budgeted = a.tier("redis")
        faulty = budgeted.inner = FaultyTier(budgeted.inner)
        faulty.failures["delete"] = 1  # one timeout; Redis answers again right after
        with pytest.raises(TierUnavailable, match="injected delete failure"):
            a.delete([key])  # reported: Redis still holds the value (kvstore/store/deletes.py)
        assert raw.exists(rkey)  # the value outlived the delete
        stuck = a.cluster.ledger.state(10.0).tiers["redis"]
        assert stuck.chunks == 1 and stuck.in_flight == 1  # still counted, this member's to finish
        done = settled(a)  # 50 heartbeats later
        try:
            b.put(key, value, durable=True)
            put_error = None
        except TierError as exc:
            put_error = str(exc)
        usage = a.cluster.ledger.state(10.0).tiers["redis"]
        on_redis = raw.exists(rkey)
    assert done, "the member never finished its failed delete: the entry stays 'evicting' and counted"
    assert put_error is None, f"no member can put the chunk on Redis any more: {put_error}"
    assert on_redis == 1 and usage.chunks == 1 and usage.used_bytes == raw.strlen(rkey)


def test_a_victim_the_medium_refused_to_delete_does_not_keep_its_bytes_counted(tmp_path, redis_server):
    """The bug: a victim the medium refused to delete stayed evicting, its bytes counted for good (fixed in 0320d8c)."""
    keys, values = chunks(3, seed=52)
    ca = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-stuck-victim", "a"))
    ca.redis.capacity_bytes = 2 * 4224  # two chunks
    raw = redis.Redis.from_url(redis_server.url)
    with Store(ca) as a:
        a.put(keys[0], values[0], durable=True)
        a.put(keys[1], values[1], durable=True)
        budgeted = a.tier("redis")
        faulty = budgeted.inner = FaultyTier(budgeted.inner)
        faulty.failures["delete"] = 1  # the eviction of keys[0] fails once
        try:
            a.put(keys[2], values[2], durable=True)
        except TierError:
            pass  # no room was made this time: the copy may fail
        done = settled(a)
        usage = a.cluster.ledger.state(10.0).tiers["redis"]
        held = [k for k in raw.scan_iter(match=ca.redis.key_prefix + "*")]
    assert done, "the failed eviction stays 'evicting' and counted for as long as the member runs"
    assert usage.used_bytes == sum(raw.strlen(k) for k in held) and usage.chunks == len(held)


def test_a_victim_whose_evicted_call_failed_leaves_the_ledger_at_the_next_settle(tmp_path, redis_server):
    """The bug: a victim whose ``evicted`` call failed was never told again: evicting for good (fixed in ee7f1fb)."""
    keys, values = chunks(3, seed=61)
    cfg = redis_member(tmp_path, redis_server.url, "rv-evicted-fails", "a")
    cfg.redis.capacity_bytes = 2 * BLOB  # the cluster's budget: two chunks
    cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    raw = redis.Redis.from_url(redis_server.url)
    rkey = lambda k: cfg.redis.key_prefix.encode() + k.id.hex().encode()  # noqa: E731
    with Store(cfg) as a:
        tier, ledger = a.cluster.tiers["redis"], a.cluster.ledger
        for k, v in zip(keys[:2], values[:2]):
            a.put(k, v, durable=True)
        real_evicted = ledger.evicted
        failed = []

        def evicted_once_unreachable(member, tier_name, key_ids):
            if not failed:
                failed.append(list(key_ids))
                raise TierUnavailable("cluster ledger: evicted: Redis out of reach (injected)")
            return real_evicted(member, tier_name, key_ids)

        ledger.evicted = evicted_once_unreachable
        try:
            a.put(keys[2], values[2], durable=True)  # makes room: the oldest chunk is the victim
        except Exception:
            pass  # the put may fail with the ledger call: what stays behind is the point here
        assert failed == [[keys[0].id]] and not raw.exists(rkey(keys[0])), "the victim was deleted, then the call failed"
        tier.settle()
        state = ledger.holder("redis", keys[0].id)
        usage = ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = [k for k in keys if raw.exists(rkey(k))]
        on_redis = (len(held), sum(raw.strlen(rkey(k)) for k in held))
    assert state is None, f"the deleted victim's entry stayed in the ledger as {state}"
    assert counted == on_redis, "the ledger counts bytes no value on Redis holds"


def test_a_delete_whose_evicted_call_failed_leaves_the_ledger_at_the_next_settle(tmp_path, redis_server):
    """The bug: a delete whose ``evicted`` call failed left its entry evicting for good (fixed in ee7f1fb)."""
    keys, values = chunks(1, seed=67)
    cfg = redis_member(tmp_path, redis_server.url, "rv-delete-evicted-fails", "a")
    cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0
    with Store(cfg) as a:
        tier, ledger = a.cluster.tiers["redis"], a.cluster.ledger
        a.put(keys[0], values[0], durable=True)
        real_evicted = ledger.evicted

        def unreachable(member, tier_name, key_ids):
            ledger.evicted = real_evicted
            raise TierUnavailable("cluster ledger: evicted: Redis out of reach (injected)")

        ledger.evicted = unreachable
        with pytest.raises(TierUnavailable):
            tier.delete(keys[0].id)
        tier.settle()
        state = ledger.holder("redis", keys[0].id)
        usage = ledger.state(10.0).tiers["redis"]
    assert state is None, f"the deleted chunk's entry stayed in the ledger as {state}"
    assert (usage.chunks, usage.used_bytes) == (0, 0)


def test_a_victim_deleted_while_the_lookup_index_was_unreachable_is_still_uncounted(tmp_path, redis_server):
    """The bug: ``forget`` raised (index unreachable) before ``evicted``: victims stayed evicting (fixed in d01e762)."""
    keys, values = chunks(3, seed=97)
    cfg = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-forget-fails"))
    cfg.redis.capacity_bytes = 2 * BLOB  # the cluster's budget: two chunks
    raw = redis.Redis.from_url(redis_server.url)
    rkey = cfg.redis.key_prefix.encode() + keys[0].id.hex().encode()
    with Store(cfg) as a:
        for k, v in zip(keys[:2], values[:2]):
            a.put(k, v, durable=True)
        failed = unlisting_fails_once(a.shared_index)
        try:
            a.put(keys[2], values[2], durable=True)  # the ledger has a evict the first chunk
        except TierError:
            pass  # the copy may fail with the index: what matters is the ledger after it
        assert [keys for _, keys in failed] == [[keys[0].id]] and not raw.exists(rkey), "the oldest chunk was evicted from Redis"
        ledger = a.cluster.ledger

        def uncounted():
            usage = ledger.state(10.0).tiers["redis"]
            return ledger.holder("redis", keys[0].id) is None and usage.in_flight == 0
        wait_until(uncounted, timeout_s=5, what="the evicted chunk's entry to be dropped (not left evicting)")
        assert a.shared_index.lookup([keys[0].id]) == {}, "the lookup index still lists the evicted chunk on Redis"
