"""A member paused past member_ttl_s in the middle of a delete removed the value another
member put after reaping it.

Member a deletes a chunk: the ledger gives it the key's entry (``deleting``), and a pauses
(a stopped VM, a long GC) before the value goes. Its heartbeat stops with it; b takes it for
dead and reaps its work: b deletes the value and drops the entry. b then puts the chunk
durably: reserved, written, committed, acknowledged. a wakes up and its delete goes on:
before the fix it removed b's value, while the ledger went on counting it. Now a checks its
lease (kvstore/cluster/lease.py) right before the medium's delete: run out, or broken since the
ledger granted the delete (a beat on waking renews it, in a new term), the delete fails as
the tier being unavailable and leaves the value. a's clock is driven by the test, the pause
held at a gate right after the ledger's answer. Real Redis."""

import threading
import time

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import quick_reaping  # noqa: E402
from faults import Call, Gate, wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import one_chunk_cluster  # noqa: E402
from tiers.base import TierError, TierUnavailable  # noqa: E402


def holds(lease) -> bool:
    try:
        lease.check(lease.term, "test")
        return True
    except TierError:
        return False


@pytest.mark.parametrize("wakes", ["asleep", "after a beat"])
def test_a_member_reaped_mid_delete_leaves_the_value_another_member_put_since(tmp_path, redis_server, wakes):
    key, value, members, raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-paused-" + wakes[0], 97)
    ca, cb = (quick_reaping(c) for c in members)
    with Store(ca) as a, Store(cb) as b:
        lease, ledger = a.cluster.lease, a.cluster.ledger
        now = [time.monotonic()]
        lease.clock = lambda: now[0]  # a's monotonic clock: it moves only when the test says
        a.put(key, value, durable=True)
        beat, deleting = ledger.beat, ledger.deleting
        parked, awake, granted = threading.Event(), threading.Event(), Gate(key.id)

        def paused_beat(*args):  # a's heartbeat stops with the rest of a
            parked.set()
            awake.wait()
            return beat(*args)

        def paused_deleting(member, tier, key_ids):  # the ledger granted the delete; a pauses
            used = deleting(member, tier, key_ids)
            granted.pass_through(key_ids[0])
            return used

        ledger.beat, ledger.deleting = paused_beat, paused_deleting
        try:
            removing = Call(lambda: a.tier("redis").delete(key.id))
            assert granted.entered.wait(10) and parked.wait(10)
            raw.zadd(ledger.prefix + "beats", {"a": 0})  # a stopped beating long ago: it is dead
            wait_until(lambda: b.cluster.ledger.holder("redis", key.id) is None and not raw.exists(rkey),
                       what="b to reap a's delete (the value gone, the entry dropped)")
            b.put(key, value, durable=True)  # acknowledged: on Redis, committed by b
            assert raw.exists(rkey)
            now[0] += ca.cluster.member_ttl_s  # the pause, on a's clock
            if wakes == "after a beat":  # a's heartbeat runs first: its lease holds again, in a new term
                awake.set()
                wait_until(lambda: holds(lease), what="a's heartbeat to renew its lease")
            granted.open()  # a's delete goes on
            assert removing.finished.wait(30)
            awake.set()
            wait_until(lambda: holds(lease), what="a's heartbeat to renew its lease")
            a.tier("redis").settle()  # what a's failed delete left is settled with the ledger
        finally:
            awake.set()
            granted.open()
        on_redis = raw.exists(rkey)
        holder = b.cluster.ledger.holder("redis", key.id)
        usage = b.cluster.ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "b's acknowledged durable value was deleted by a's delete, resumed after a was reaped"
    assert isinstance(removing.error, TierUnavailable), f"a's fenced delete answered {removing.error!r}"
    assert (holder, counted) == (("r", "b"), held), "the ledger does not count what Redis holds"


def test_an_undo_retried_after_its_member_was_reaped_leaves_the_value_another_member_put_since(redis_server):
    """``undoing`` keeps a 'mine' under its token, so that the retry of a call whose reply was
    lost answers it again. w's undo runs, its reply is lost, w pauses and is reaped: r deletes
    the value and drops the entry, x puts the key and commits it. w wakes, beats (its lease
    holds again), and its heartbeat retries the undo: before the fix the token alone answered
    'mine', and w deleted x's value. The ledger's scripts driven one call at a time."""
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
