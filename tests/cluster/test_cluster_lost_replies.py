"""The ledger's scripts when a Redis reply is lost: redis-py runs the command again once on a
fresh connection after a timeout (tiers/redis.py ``connect``), so a script may run twice, or
run once with its member never told. The unit promises that the second run answers as the
first did, or as the entry stands now where it changed since, and that what the member never
learned is finished by its heartbeat: no key stays evicting or counted for good, no value is
deleted that another member was told is there. Real Redis; the lost reply is injected where
redis-py reads it (cluster_faults.lose_reply_once)."""

import threading

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import lose_reply_once, quick_reaping, quick_retrying, settled  # noqa: E402
from faults import FaultyTier, wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, redis_member  # noqa: E402
from tiers.base import TierError  # noqa: E402

KEY = b"\x6b" * 32


@pytest.mark.parametrize("retry", ["retried", "retry fails too"])
def test_a_dead_members_write_handed_over_by_a_beat_whose_reply_was_lost_is_still_finished(tmp_path, redis_server,
                                                                                          retry):
    """The bug: the retried beat that reaped d answered nothing; d's key stayed evicting for good (fixed in 6562c91)."""
    prefix = "rv-beat-lost-" + retry.split()[-1]
    cb = quick_reaping(redis_member(tmp_path, redis_server.url, prefix, "b"))
    raw = redis.Redis.from_url(redis_server.url)
    with Store(cb) as b:
        ledger = b.cluster.ledger
        beat = ledger.beat
        parked, go = threading.Event(), threading.Event()

        def held_beat(*args, **kwargs):  # b's next heartbeat waits here until d is dead
            parked.set()
            go.wait()
            return beat(*args, **kwargs)

        ledger.beat = held_beat
        assert parked.wait(10)
        d = Ledger(redis_server.url, cb.shared_index.key_prefix, False)
        try:
            d.join("d", {"redis": cb.redis.capacity_bytes}, {})
            assert d.reserve("d", "redis", KEY, BLOB, BLOB, 10.0)[0] == "ok"
        finally:
            d.close()
        raw.zadd(ledger.prefix + "beats", {"d": 0})  # d stopped beating long ago: it is dead
        lose_reply_once(ledger, "beat", unreachable_after=retry != "retried")
        ledger.beat = beat
        go.set()  # the held beat reaps d; its reply is lost

        def finished():
            usage = ledger.state(10.0).tiers["redis"]
            return ledger.holder("redis", KEY) is None and usage.in_flight == 0 and usage.used_bytes == 0
        wait_until(finished, timeout_s=5, what="b to finish d's unfinished write (its entry dropped, its bytes free)")


@pytest.mark.parametrize("retry", ["retried", "retry fails too"])
def test_a_commit_whose_reply_was_lost_keeps_the_value_another_member_was_told_is_there(tmp_path, redis_server, retry):
    """The bug: a retried commit answered 0 and its undo deleted a value b was told is there (fixed in 0320d8c)."""
    keys, values = chunks(1, seed=41)
    key, value = keys[0], values[0]
    prefix = "rv-commit-lost-" + retry.split()[-1]
    ca = redis_member(tmp_path, redis_server.url, prefix, "a")
    cb = redis_member(tmp_path, redis_server.url, prefix, "b")
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + key.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        acked = []

        def b_puts_it_meanwhile():  # a's commit ran: the entry is resident, the value is on Redis
            b.put(key, value, durable=True)  # the ledger says "present": acknowledged, nothing written
            acked.append(raw.exists(rkey))

        armed = lose_reply_once(a.cluster.ledger, "commit", b_puts_it_meanwhile, retry == "retry fails too")
        try:
            a.put(key, value, durable=True)
        except Exception:
            pass  # a's own put may fail: its outcome is not what this test is about
        assert not armed[0] and acked == [1], "b's durable put ran while a's commit reply was lost"
        on_redis = raw.exists(rkey)
        usage = a.cluster.ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "b's acknowledged durable put has no copy: a's undo deleted the value after a retried commit"
    assert counted == held, "the ledger counts a value Redis does not hold"


@pytest.mark.parametrize("retry", ["retried", "retry fails too"])
def test_the_victims_of_a_make_room_whose_reply_was_lost_are_deleted_and_uncounted(tmp_path, redis_server, retry):
    """The bug: a retried make_room chose more victims; the first run's stayed evicting for good (fixed in 0320d8c)."""
    keys, values = chunks(4, seed=61)
    ca = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-room-lost-" + retry.split()[-1], "a"))
    ca.redis.capacity_bytes = 3 * BLOB
    raw = redis.Redis.from_url(redis_server.url)
    with Store(ca) as a:
        for k, v in zip(keys[:3], values[:3]):
            a.put(k, v, durable=True)
        armed = lose_reply_once(a.cluster.ledger, "make_room", unreachable_after=retry == "retry fails too")
        try:
            a.put(keys[3], values[3], durable=True)  # needs room: the oldest chunk is the victim
        except TierError:
            assert retry == "retry fails too"  # the ledger unreachable: the copy fails, honestly
        assert not armed[0]
        done = settled(a)
        usage = a.cluster.ledger.state(10.0).tiers["redis"]
        held = list(raw.scan_iter(match=ca.redis.key_prefix + "*"))
        evicted = 3 + raw.exists(ca.redis.key_prefix.encode() + keys[3].id.hex().encode()) - len(held)
    assert done, "the first run's victims stay 'evicting' in this member's set for good"
    assert usage.used_bytes == sum(raw.strlen(k) for k in held) and usage.chunks == len(held)
    assert evicted == 1, f"{evicted} chunks evicted to make room for one"


def test_an_undo_whose_ledger_reply_was_lost_frees_the_key(tmp_path, redis_server):
    """The bug: a retried ``undoing`` found its entry evicting and answered busy for ever (fixed in 92e6ec3)."""
    keys, values = chunks(1, seed=89)
    key, value = keys[0], values[0]
    with Store(redis_member(tmp_path, redis_server.url, "rv-undo-lost", "a")) as a:
        tier = a.tier("redis")
        faulty = tier.inner = FaultyTier(tier.inner)
        faulty.failures["write"] = 1  # the write fails: its reservation is undone
        lose_reply_once(tier.ledger, "undoing")
        with pytest.raises(TierError):
            a.put(key, value, durable=True)
        tier.settle()
        assert tier.ledger.holder("redis", key.id) is None, "the undo whose reply was lost left the key's entry taken"
        a.put(key, value, durable=True)
        assert tier.ledger.holder("redis", key.id) == ("r", "a")


def test_an_undo_retried_after_its_member_was_reaped_leaves_the_value_another_member_put_since(redis_server):
    """The bug: a reaped member's retried undo answered 'mine' by its token, deleting x's value (fixed in 65a1dca)."""
    prefix, tier, blob, key = "paused-undo:", "redis", 4224, b"\x61" * 32
    raw = redis.Redis.from_url(redis_server.url)
    ledger = Ledger(redis_server.url, prefix, False)
    try:
        for m in "wrx":
            ledger.join(m, {tier: 16 * blob}, {})
        assert ledger.reserve("w", tier, key, blob, blob, 10.0)[0] == "ok"
        assert ledger.undoing("w", tier, key, "undo-1") == "mine"  # its reply is lost: w retries later
        raw.zadd(ledger.prefix + "beats", {"w": 0})  # w paused past member_ttl_s: it is dead
        assert (tier, key) in ledger.beat("r", {}, 10.0, 3600.0)  # r reaps it, deletes the value...
        ledger.evicted("r", tier, [key])  # ...and drops the entry
        assert ledger.reserve("x", tier, key, blob, blob, 10.0)[0] == "ok" and ledger.commit("x", tier, key)
        ledger.beat("w", {}, 10.0, 3600.0)  # w wakes
        retried = ledger.undoing("w", tier, key, "undo-1")
        holder = ledger.holder(tier, key)
    finally:
        ledger.close()
    assert retried == "kept", "w's retried undo was told to delete the value x put after w was reaped"
    assert holder == ("r", "x")
