"""Dead members: a member whose heartbeats stop is reaped by a live one, whose heartbeat is
handed the dead member's unfinished work (kvstore/cluster/member.py, ``beat.lua``). The unit
promises that this work is finished on every shared tier, by a member that mounts the tier,
even where one tier's part fails; and that a member taken for dead while it still wrote or
deleted (a long pause) never removes a value another member put since: its late writes are
undone only while it holds the entry, its late deletes are fenced by its lease
(kvstore/cluster/lease.py). Real Redis, a PFS directory where a test mounts two tiers."""

import threading
import time

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import quick_reaping  # noqa: E402
from faults import Call, FaultyTier, Gate, unlisting_fails_once, wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, daemon_config, one_chunk_cluster, redis_member  # noqa: E402
from tiers.base import TierError, TierUnavailable  # noqa: E402

TWO_TIERS_KEY = b"\x7c" * 32
UNMOUNTED_KEY = b"\x3d" * 32


def holds(lease) -> bool:
    try:
        lease.check(lease.term, "test")
        return True
    except TierError:
        return False


def test_a_member_reaped_mid_write_leaves_the_value_another_member_put_durably(tmp_path, redis_server):
    """The bug: a reaped member's late write failed its commit and its undo deleted b's value (fixed in 0320d8c)."""
    keys, values = chunks(1, seed=71)
    key, value = keys[0], values[0]
    ca = quick_reaping(redis_member(tmp_path, redis_server.url, "rv-reaped", "a"))
    cb = quick_reaping(redis_member(tmp_path, redis_server.url, "rv-reaped", "b"))
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + key.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        awake = threading.Event()
        beat = a.cluster.ledger.beat
        stalled = [False]

        def stalling_beat(*args):  # a's heartbeat thread stalls, as in a long pause of the process
            if stalled[0]:
                awake.wait()
            return beat(*args)

        a.cluster.ledger.beat = stalling_beat
        budgeted = a.tier("redis")
        faulty = budgeted.inner = FaultyTier(budgeted.inner)
        gate = faulty.gates["write"] = Gate(key.id)
        try:
            stalled[0] = True
            putting = Call(lambda: a.put(key, value, durable=True))
            assert gate.entered.wait(10)  # reserved; its SET not sent yet
            ledger = b.cluster.ledger

            def reaped():
                state = ledger.state(0.5)
                a_live = next(m.live for m in state.members if m.name == "a")
                return not a_live and state.tiers["redis"].chunks == 0
            wait_until(reaped, what="b's heartbeat reaping a's unfinished write")
            b.put(key, value, durable=True)  # acknowledged: committed by b
            assert raw.exists(rkey)
        finally:
            stalled[0] = False
            awake.set()
            gate.open()  # a wakes up: its write lands, its commit fails
        try:
            putting.outcome()
        except Exception:
            pass  # a's put fails: it was taken for dead meanwhile
        on_redis = raw.exists(rkey)
        usage = ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "b's acknowledged durable value was deleted by the undo of a's late write"
    assert counted == held


@pytest.mark.parametrize("wakes", ["asleep", "after a beat"])
def test_a_member_reaped_mid_delete_leaves_the_value_another_member_put_since(tmp_path, redis_server, wakes):
    """The bug: a member paused mid-delete, reaped, woke and removed b's value (fixed in fc7dcd4; test 20a26e3)."""
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


def test_a_dead_members_work_on_every_tier_is_finished_when_one_tiers_removal_fails(tmp_path, redis_server):
    """The bug: one tier's failed removal ended the loop; the other tier's keys stayed evicting (fixed in 9b2b548)."""
    cfg = quick_reaping(daemon_config(tmp_path, "b", redis_server.url, True, "rv-reap-two", pfs=True))
    cfg.cluster.enabled, cfg.cluster.member = True, "b"
    with Store(cfg) as b:
        failed = unlisting_fails_once(b.shared_index)
        budgets = {"pfs": cfg.pfs.capacity_bytes, "redis": cfg.redis.capacity_bytes}
        d = Ledger(redis_server.url, cfg.shared_index.key_prefix, False)
        try:  # d reserves the chunk on both tiers and dies before writing either
            d.join("d", budgets, {})
            for tier in budgets:
                assert d.reserve("d", tier, TWO_TIERS_KEY, BLOB, BLOB, 10.0)[0] == "ok"
        finally:
            d.close()
        ledger = b.cluster.ledger

        def finished():
            state = ledger.state(10.0)
            return all(ledger.holder(t, TWO_TIERS_KEY) is None and state.tiers[t].in_flight == 0 for t in budgets)
        wait_until(finished, timeout_s=5, what="b to finish d's unfinished writes on both tiers")
        assert failed, "the removal on the first tier did not fail"


def test_a_dead_members_work_on_a_tier_the_reaper_lacks_is_handed_to_a_member_with_it(tmp_path, redis_server):
    """The bug: a reaper without the tier took the dead member's work on it, evicting for good (fixed in 1b8ea6c)."""
    cfg = quick_reaping(daemon_config(tmp_path, "p", redis_server.url, True, "rv-reaper-tier", pfs=True))
    cfg.redis.enabled = False  # p mounts the PFS directory only
    cfg.cluster.enabled, cfg.cluster.member = True, "p"
    budgets = {"pfs": cfg.pfs.capacity_bytes, "redis": 1 << 22}
    with Store(cfg) as p:
        d = Ledger(redis_server.url, cfg.shared_index.key_prefix, False)
        try:  # d and x mount both tiers; d reserves the chunk on both and dies before writing it
            d.join("x", budgets, {})
            d.join("d", budgets, {})
            for tier in budgets:
                assert d.reserve("d", tier, UNMOUNTED_KEY, BLOB, BLOB, 10.0)[0] == "ok"
            wait_until(lambda: d.holder("pfs", UNMOUNTED_KEY) is None, what="p to reap d and finish its PFS write")
            handed = d.beat("x", {}, 0.5, 3600.0)  # x is live: its heartbeat reaps what p could not
        finally:
            d.close()
    assert ("redis", UNMOUNTED_KEY) in handed, "d's unfinished Redis write was taken by p, which cannot delete it"
