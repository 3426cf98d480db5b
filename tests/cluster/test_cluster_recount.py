"""The budget's recount: a re-put (another codec) whose copy fails leaves the older value of
the chunk on the medium, and BudgetedTier._undo releases the write's reservation, then counts
that older value again (``_recount``), or deletes it where the budget has no room for it. The
unit promises that the older value ends counted and evictable, or deleted, even where a ledger
call of the recount failed (the heartbeat's ``settle`` does it again), and that the recount
never deletes nor counts over a value another write put since: it deletes only once
``Ledger.undoing`` gave it the key's entry. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import CommitFailsOnce, failed_recount, failing_re_put, lose_reply_once  # noqa: E402
from faults import Gate  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, one_chunk_cluster  # noqa: E402


def members(tmp_path, url, how, seed):
    prefix = f"rv-recount-fails-{how.split()[0]}-{seed}"  # each test its own keys and budget on the shared Redis
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, url, prefix, seed)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = 2 * BLOB - 1  # one chunk fits, not two
        cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    return key, value, ca, cb, raw, rkey


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


@pytest.mark.parametrize("how", ["unreachable", "reply lost", "release fails"])
def test_a_recount_that_failed_is_counted_again_by_the_heartbeat(tmp_path, redis_server, how):
    """The bug: a failed recount was only logged: the older value uncounted, or pending for good (fixed in 0c2d975)."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, how, 113)
    (filler,), (filler_value,) = chunks(1, seed=127)
    frkey = ca.redis.key_prefix.encode() + filler.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        tier = failed_recount(a, key, value, how)
        older = raw.get(rkey)
        tier.settle()  # the heartbeat
        ledger = b.cluster.ledger
        settled = (raw.get(rkey) == older, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
        assert settled == (True, ("r", "a"), len(older)), \
            "the older value is not counted and committed as a's after the heartbeat"
        b.put(filler, filler_value, durable=True)  # no room for both: the older value is evicted
        after = (raw.exists(rkey), raw.exists(frkey), ledger.state(10.0).tiers["redis"].used_bytes)
    assert after == (0, 1, raw.strlen(frkey)), "the older value was not evicted: the budget is exceeded"


def test_a_pending_recount_keeps_what_another_member_wrote_since(tmp_path, redis_server):
    """The bug: a failed recount was only logged; here b's put wrote over the older value since (fixed in 0c2d975)."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, "unreachable", 131)
    with Store(ca) as a, Store(cb) as b:
        tier = failed_recount(a, key, value, "unreachable")
        b.put(key, value, codec="int8", durable=True)
        ours = b.get_blob(key)
        tier.settle()
        ledger = b.cluster.ledger
        state = (raw.get(rkey) == ours, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
    assert state == (True, ("r", "b"), len(ours)), "the heartbeat counted the older value in place of b's"


def test_a_pending_recount_keeps_what_this_member_wrote_since(tmp_path, redis_server):
    """The bug: a failed recount was only logged; here a's own write took the entry over since (fixed in 0c2d975)."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, "reply lost", 137)
    with Store(ca) as a:
        tier = failed_recount(a, key, value, "reply lost")
        ours = a.get_blob(key)  # the re-put's int8 blob, in a's host RAM
        assert ours != raw.get(rkey)
        tier.write(key.id, [ours])
        ledger = a.cluster.ledger
        tier.settle()
        state = (raw.get(rkey) == ours, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
    assert state == (True, ("r", "a"), len(ours)), "the heartbeat counted the older value in place of a's new one"


def test_a_pending_recount_of_a_value_gone_since_releases_its_reservation(tmp_path, redis_server):
    """The bug: a failed recount was only logged; here Redis dropped the older value since (fixed in 0c2d975)."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, "reply lost", 139)
    with Store(ca) as a:
        tier = failed_recount(a, key, value, "reply lost")
        raw.delete(rkey)
        tier.settle()
        ledger = a.cluster.ledger
        state = (ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
    assert state == (None, 0), "the reservation whose reply was lost stayed after its value was gone"


def test_the_recount_of_an_older_value_leaves_a_value_another_member_put_durably_since(tmp_path, redis_server):
    """The bug: a recount with no room deleted the value under the key without its entry: b's (fixed in 298135b)."""
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
    """The bug: a recount whose ``undoing`` reply was lost left the key busy to every member (fixed in 298135b)."""
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
    """The bug: a recount whose commit failed stayed pending, busy to others, while a lived (fixed in a15ac09)."""
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
