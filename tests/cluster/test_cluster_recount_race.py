"""The recount of an older value deleted another member's acknowledged value.

Member a's copy of a re-put (another codec) fails before it lands; the older value of the
chunk stays on Redis, and BudgetedTier._undo releases a's reservation, then counts the older
value again (``_recount``). When the budget had no room for it any more, the recount deleted
the value under the key while a held no entry of it: b had reserved, written and committed
the chunk since (a durable put, acknowledged), and a's delete removed b's value while the
ledger kept counting it. The recount now deletes only once ``Ledger.undoing`` gave a the
key's entry. Also: a recount's commit that failed left a's reservation pending for as long
as a lived (the chunk busy to every other member, its bytes never evictable); ``settle``
commits it again now. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import CommitFailsOnce, failing_re_put, lose_reply_once  # noqa: E402
from faults import Gate  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, one_chunk_cluster  # noqa: E402


class HeldAfterRelease:
    """A member's ledger that holds the member at ``gate`` right after it released its own
    reservations (the undo of a failed write), before it counts the older value again."""

    def __init__(self, ledger, gate):
        self._ledger, self.gate = ledger, gate

    def __getattr__(self, name):
        return getattr(self._ledger, name)

    def release(self, member, tier, key_ids, own_only=False):
        used = self._ledger.release(member, tier, key_ids, own_only)
        if own_only:
            for key_id in key_ids:
                self.gate.pass_through(key_id)
        return used


def test_the_recount_of_an_older_value_leaves_a_value_another_member_put_durably_since(tmp_path, redis_server):
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-recount-race", 97)
    (filler,), (filler_value,) = chunks(1, seed=101)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = 2 * BLOB - 1  # the raw older value and b's filler do not both fit
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)  # the older value: raw, on Redis
        tier = failing_re_put(a)
        released = Gate(key.id)
        tier.ledger = HeldAfterRelease(tier.ledger, released)
        a.put(key, value, codec="int8")  # its copy fails: a's undo releases, then recounts the raw value
        assert released.entered.wait(10)  # the raw value is uncounted, its key without an entry
        b.put(filler, filler_value, durable=True)
        b.put(key, value, codec="int8", durable=True)  # acknowledged: b's int8 blob on Redis, committed
        ours = b.get_blob(key)
        released.open()  # a's recount finds no room for the raw value
        assert a.flush(30)
        on_redis = raw.get(rkey)
        holder = b.cluster.ledger.holder("redis", key.id)
        used = b.cluster.ledger.state(10.0).tiers["redis"].used_bytes
    assert on_redis == ours, "b's acknowledged durable value was deleted by the recount of a's older value"
    assert (holder, used) == (("r", "b"), BLOB + len(ours)), "the ledger does not count what Redis holds"


def test_a_recount_whose_undoing_reply_was_lost_deletes_the_older_value_at_the_next_beat(tmp_path, redis_server):
    """``undoing`` ran (the entry is a's, evicting) and both its reply and redis-py's retry
    were lost: unless settled, the key stayed busy to every member for as long as a lived."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-recount-lost", 107)
    (filler,), (filler_value,) = chunks(1, seed=109)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = 2 * BLOB - 1
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)
        tier = failing_re_put(a)
        released = Gate(key.id)
        tier.ledger = HeldAfterRelease(tier.ledger, released)
        lose_reply_once(a.cluster.ledger, "undoing", unreachable_after=True)
        a.put(key, value, codec="int8")
        assert released.entered.wait(10)
        b.put(filler, filler_value, durable=True)  # no room left for the raw value
        released.open()
        assert a.flush(30)
        tier.settle()  # the heartbeat
        assert (tier.ledger.holder("redis", key.id), raw.exists(rkey)) == (None, 0), \
            "the older value's entry stayed taken after the reply of its undoing was lost"
        b.delete([filler])
        b.put(key, value, durable=True)  # the chunk is not busy to every member for good
        assert raw.get(rkey) == b.get_blob(key)


def test_a_recount_whose_commit_failed_is_committed_by_the_heartbeat(tmp_path, redis_server):
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-recount-commit", 103)
    cb.cluster.busy_wait_s = 1.0  # b's put gives up soon on a key another member holds
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True)  # the older value: raw, on Redis
        tier = failing_re_put(a)
        tier.ledger = failing = CommitFailsOnce(tier.ledger)
        a.put(key, value, codec="int8")  # its copy fails; the recount reserves the raw value, its commit fails
        assert a.flush(30) and failing.failed
        tier.settle()  # the heartbeat
        assert tier.ledger.holder("redis", key.id) == ("r", "a"), \
            "the recount's reservation stayed pending after its commit failed"
        b.put(key, value, durable=True, codec="int8")  # the chunk is not busy to another member for good
        assert raw.get(rkey) == b.get_blob(key)
