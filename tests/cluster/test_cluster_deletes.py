"""A delete that the medium refused left the chunk's ledger entry
"evicting" for as long as the member lived.

``BudgetedTier.delete`` (and ``remove``, for the victims ``make_room`` names) marks the
entry ``e`` and puts it in the member's set of values it deletes; when the medium's delete
fails (a timeout, Redis down for a moment) nothing ever tries again while the member runs
(docs/cluster.md promises "the member, or whoever reaps it, deletes it later"; only a
restart or a reaping does). Meanwhile the bytes stay counted against the cluster's budget,
and every member's reservation of that chunk is answered "busy": after ``busy_wait_s`` the
copy fails, so no member can put the chunk durably on that tier again, ever. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import quick_retrying, settled  # noqa: E402
from faults import FaultyTier  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402
from tiers.base import TierError, TierUnavailable  # noqa: E402


def test_a_delete_the_medium_refused_once_is_finished_and_the_chunk_can_be_put_again(tmp_path, redis_server):
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
    """make_room's victims: the same, through ``remove``: their bytes stay counted, so the
    cluster's budget shrinks by every failed eviction until the member restarts."""
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
