"""A victim this member deleted for the cluster's budget, whose ``evicted`` call to the
ledger failed, is told to the ledger again by the heartbeat.

make_room marks its victims evicting (state e); BudgetedTier.remove deletes each value,
then tells the ledger, which drops the entries. When that call failed (the ledger out of
reach for a moment), nobody told it again: the entries stayed evicting for good. Nobody
could write those chunks again (a reservation of an evicting entry is answered "busy"), and
their bytes stayed counted against the budget with no value on the medium. A delete whose
``evicted`` call failed left its entry evicting the same way. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, redis_member  # noqa: E402
from tiers.base import TierUnavailable  # noqa: E402


def test_a_victim_whose_evicted_call_failed_leaves_the_ledger_at_the_next_settle(tmp_path, redis_server):
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
