"""A write's reserve whose reply was lost, and the release of a failed write's reservation.

A reserve that ran, whose reply was lost (redis-py's retry too), failed its write with
TierError and nothing remembered it: the key's entry stayed this member's, pending, for as
long as the member lived. Every other member's reserve of the chunk was answered busy (a
durable put of it failed), its bytes stayed counted, and where the reservation had replaced
the entry of a value on the medium (one of another size), that value was counted by nobody.
BudgetedTier now remembers the key (``_owed``), and ``settle`` (the heartbeat) releases this
member's own pending entry, then counts again the value still on the medium.

That release ran outside the ordering of settles against writes of the same key
(``_settle_keys``), as did the one of a reservation ``_undo`` could not release (the
ledger unreachable): a new write of the key by this member, in flight, had taken the
pending entry over; the release dropped it, the write's commit answered 0, its undo deleted
the value just written (the chunk left with no copy on Redis, the older value replaced) and
the write failed for nothing. ``_owed`` is now settled under that ordering: a key being
written is left for the next beat. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import failed_recount, lose_reply_once  # noqa: E402
from faults import Call, FaultyTier, Gate  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, one_chunk_cluster  # noqa: E402
from tiers.base import TierError  # noqa: E402


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
    """a's reservation of the key stays pending (``how``), its release owed to the heartbeat;
    a's next write of the key takes the entry over, and the heartbeat comes while it writes."""
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
