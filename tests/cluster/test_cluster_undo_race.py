"""The undo of a write whose commit was refused deleted another member's acknowledged value.

Member a's copy of a durable put has written its value and not committed it when b deletes
the chunk (b takes the entry, removes the value, drops the entry). a's commit is refused and
BudgetedTier undoes the write: before the fix it asked the ledger who held the entry (nobody:
dropped; or a, the owner named in the entry b's delete still held) and then, in a second
step, deleted the value under the key. In between b put the chunk durably: reserved,
written, committed, acknowledged; a's delete removed that value, and the ledger kept
counting it. The undo now deletes only while it holds the key's entry itself
(``Ledger.undoing``). Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import HeldAfterDelete, HeldAfterWrite, lose_reply_once, watch_ledger  # noqa: E402
from faults import Call, FaultyTier, Gate, wait_until  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402
from tiers.base import TierError  # noqa: E402


@pytest.mark.parametrize("entry", ["dropped", "held by the delete"])
def test_the_undo_of_a_refused_commit_leaves_a_value_another_member_put_durably_since(tmp_path, redis_server, entry):
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


def test_an_undo_whose_ledger_reply_was_lost_frees_the_key(tmp_path, redis_server):
    """redis-py runs ``undoing`` again when its reply is lost: the second run finds the entry
    evicting, and without the token it answered 'busy' for ever, the key unwritable by any
    member (its entry this member's, evicting, with nobody to drop it)."""
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
