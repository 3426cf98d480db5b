"""Writes the ledger did not see through: a write reserves the key's entry, writes its value
and commits (BudgetedTier.write); where a step fails (the reserve's reply lost, the commit
refused, failed or lost, the release of a failed write's reservation) the write is undone, or
what the ledger still owes is remembered and done by the heartbeat's ``settle``. The unit
promises that the entry ends committed, released or dropped, the chunk writable by every
member again, and that neither an undo nor a settle removes or releases a value another
write put since (the member's own newer write or another member's). Real Redis."""

import threading

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import (  # noqa: E402
    CommitFailsOnce,
    HeldAfterDelete,
    HeldAfterWrite,
    failed_recount,
    lose_reply_once,
    watch_ledger,
)
from faults import Call, FaultyTier, Gate, wait_until  # noqa: E402
from kvstore.blob import encode_header  # noqa: E402
from kvstore.codecs import resolve_codec  # noqa: E402
from kvstore.codecs.raw import tensor_bytes  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, one_chunk_cluster, redis_member  # noqa: E402
from tiers.base import TierError, TierFull  # noqa: E402


def members(tmp_path, url, prefix, seed):
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, url, prefix, seed)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = 2 * BLOB - 1  # one chunk fits, not two
        cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    cb.cluster.busy_wait_s = 1.0  # b's put gives up soon on a key another member holds
    return key, value, ca, cb, raw, rkey


def reserve_lost(a, key, value, older):
    """a's put of the chunk (int8, over its raw durable put if ``older``) whose reserve runs
    and loses its reply, and redis-py's retry's."""
    if older:
        a.put(key, value, durable=True)
    armed = lose_reply_once(a.cluster.ledger, "reserve", unreachable_after=True)
    if older:
        a.put(key, value, codec="int8")
        assert a.flush(30)
    else:
        with pytest.raises(TierError):
            a.put(key, value, durable=True)
    assert not armed[0]
    return a.tier("redis")


@pytest.mark.parametrize("older", [False, True], ids=["no older value", "over an older value"])
def test_a_reserve_whose_reply_was_lost_is_released_by_the_heartbeat(tmp_path, redis_server, older):
    """The bug: a reserve whose reply was lost left a's entry pending, the chunk busy to all (fixed in 549af02)."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, f"rv-reserve-lost-{older}", 157)
    with Store(ca) as a, Store(cb) as b:
        tier = reserve_lost(a, key, value, older)
        there = raw.get(rkey)
        tier.settle()  # the heartbeat
        ledger = b.cluster.ledger
        settled = (raw.get(rkey) == there, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
        expected = (True, ("r", "a"), len(there)) if older else (True, None, 0)
        assert settled == expected, "a's reservation whose reply was lost is not released, or the value not counted"
        b.put(key, value, codec="int8", durable=True)  # busy to b for as long as a lived, before
        assert raw.get(rkey) == b.get_blob(key)


@pytest.mark.parametrize("how", ["reserve reply lost", "release fails"])
def test_the_heartbeat_leaves_a_later_write_of_the_key_in_flight(tmp_path, redis_server, how):
    """The bug: the heartbeat released an owed reservation a newer write had taken over (fixed in 12eea2b)."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, "rv-owed-" + how.split()[0], 149)
    with Store(ca) as a:
        if how == "release fails":
            tier = failed_recount(a, key, value, how)
        else:
            tier = reserve_lost(a, key, value, older=False)
            tier.inner = FaultyTier(tier.inner)
        ours = a.get_blob(key)  # the failed put's blob, in a's host RAM
        wrote = Gate(key.id)
        tier.inner.gates["write"] = wrote
        writing = Call(lambda: tier.write(key.id, [ours]))
        assert wrote.entered.wait(10)
        tier.settle()  # the heartbeat, while the write is held before its value lands
        wrote.open()
        writing.join(30)
        assert writing.error is None, f"a's write of the key failed for nothing: {writing.error}"
        tier.settle()  # the next beat
        ledger = a.cluster.ledger
        state = (raw.get(rkey) == ours, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
    assert state == (True, ("r", "a"), len(ours)), "a's write is not what Redis holds and the ledger counts"


def test_a_write_refused_full_leaves_the_lost_commit_to_the_heartbeat(tmp_path, redis_server):
    """The bug: a write refused full dropped an earlier write's failed commit: pending for good (fixed in 5288830)."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-refused-lost-commit", 163)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = BLOB - 1  # the int8 blob fits, the raw one does not
        cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    cb.cluster.busy_wait_s = 1.0
    payload = resolve_codec("raw").encode(value)
    bigger = encode_header(key, resolve_codec("raw").codec_id, value.dtype, value.shape, payload) + bytes(payload)
    with Store(ca) as a, Store(cb) as b:
        tier = a.tier("redis")
        tier.ledger = failing = CommitFailsOnce(tier.ledger)
        with pytest.raises(TierError):
            a.put(key, value, codec="int8", durable=True)
        assert failing.failed
        there = raw.get(rkey)
        with pytest.raises(TierFull):
            tier.write(key.id, [bigger])
        tier.settle()  # the heartbeat
        ledger = b.cluster.ledger
        settled = (raw.get(rkey) == there, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
        assert settled == (True, ("r", "a"), len(there)), "a's failed commit is forgotten: the entry stays pending"
        b.put(key, value, codec="int8", durable=True)  # busy to b for as long as a lived, before
        assert raw.get(rkey) == b.get_blob(key) == there
        b.tier("redis").make_room(BLOB - 1)  # the whole budget: a's value was never evictable, before
        evicted = (raw.exists(rkey), ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
        assert evicted == (0, None, 0)


def test_a_settle_that_undoes_a_taken_write_keeps_a_newer_write_of_the_key(tmp_path, redis_server):
    """The bug: settle's undo of a taken write deleted the value a newer write of the key wrote (fixed in ee7f1fb)."""
    keys, values = chunks(1, seed=53)
    key, value = keys[0], values[0]
    cfg = redis_member(tmp_path, redis_server.url, "rv-settle-rewrite", "a")
    cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    raw = redis.Redis.from_url(redis_server.url)
    rkey = cfg.redis.key_prefix.encode() + key.id.hex().encode()
    payload = tensor_bytes(value)
    parts = [encode_header(key, 0, value.dtype, value.shape, payload), payload]
    with Store(cfg) as a:
        tier = a.cluster.tiers["redis"]
        ledger = a.cluster.ledger
        lose_reply_once(ledger, "commit", unreachable_after=True)
        with pytest.raises(TierError):
            tier.write(key.id, parts)  # the commit ran; its reply, and the retry's, were lost
        tier.delete(key.id)  # the entry is taken from this member: settle's commit answers False

        rewrite = threading.Thread(target=tier.write, args=(key.id, parts))
        real_undoing = ledger.undoing

        def undoing(*args):  # settle's undo asks the ledger for the entry: a new write ran first
            if not rewrite.is_alive() and rewrite.ident is None:
                rewrite.start()
                rewrite.join(1.0)  # with the fix it waits for the settle to end
            return real_undoing(*args)

        ledger.undoing = undoing
        tier.settle()
        rewrite.join(30)
        assert rewrite.ident is not None and not rewrite.is_alive()
        on_redis = raw.exists(rkey)
        usage = ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "the settle's undo deleted the value a newer write of the key had written and committed"
    assert counted == held, "the ledger counts a value Redis does not hold"


@pytest.mark.parametrize("entry", ["dropped", "held by the delete"])
def test_the_undo_of_a_refused_commit_leaves_a_value_another_member_put_durably_since(tmp_path, redis_server, entry):
    """The bug: the undo of a refused commit deleted in a second step b's value put since (fixed in 92e6ec3)."""
    keys, values = chunks(1, seed=83)
    key, value = keys[0], values[0]
    prefix = "rv-undo-race-" + entry.split()[0]
    ca = redis_member(tmp_path, redis_server.url, prefix, "a")
    cb = redis_member(tmp_path, redis_server.url, prefix, "b")
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + key.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        written, undoing, b_deleted = Gate(key.id), Gate(key.id), Gate(key.id)
        a_tier, b_tier = a.tier("redis"), b.tier("redis")
        faulty = a_tier.inner = FaultyTier(HeldAfterWrite(a_tier.inner, written))
        faulty.gates["delete"] = undoing  # holds a's undo right before it deletes the value
        putting_a = Call(lambda: a.put(key, value, durable=True))
        assert written.entered.wait(10)  # a's value is on Redis, its entry pending
        if entry == "dropped":
            assert b_tier.delete(key.id)  # the entry is taken from a and dropped: a's value is gone
        else:
            b_tier.inner = HeldAfterDelete(b_tier.inner, b_deleted)
            deleting = Call(lambda: b_tier.delete(key.id))
            assert b_deleted.entered.wait(10)  # a's value is gone; b's delete still holds the entry
        written.open()  # a's commit is refused: a undoes its write
        wait_until(lambda: undoing.entered.is_set() or putting_a.finished.is_set(), what="a's undo")
        if entry != "dropped":
            b_deleted.open()
            deleting.outcome()  # the entry is dropped
        seen = watch_ledger(b)
        putting_b = Call(lambda: b.put(key, value, durable=True))
        wait_until(lambda: seen.busy.is_set() or putting_b.finished.is_set(), what="b's copy to ask the ledger")
        undoing.open()
        putting_b.outcome()  # acknowledged: on Redis
        assert putting_a.finished.wait(30) and putting_a.error is not None  # a's write was taken: its put fails
        a_tier.settle()  # whatever undo a left for its heartbeat is done now
        on_redis = raw.exists(rkey)
        holder = b.cluster.ledger.holder("redis", key.id)
        usage = b.cluster.ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "b's acknowledged durable value was deleted by the undo of a's refused commit"
    assert (holder, counted) == (("r", "b"), held), "the ledger does not count what Redis holds"
