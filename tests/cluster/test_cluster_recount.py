"""The recount of an older value was lost when the ledger could not be reached.

Member a's copy of a re-put (another codec) fails before it lands; the older value of the
chunk stays on Redis, and BudgetedTier._undo releases a's reservation, then counts the older
value again (``_recount``). When that reserve failed, the recount was only logged:

- it did not reach Redis (or the undo's release failed and only ``settle`` released it): the
  key had no entry, the value stayed on Redis counted by nobody and evictable by nobody, and
  the budget was exceeded by its size for good;
- it ran and its reply was lost (redis-py's retry too): the entry stayed a's, pending, never
  committed: the chunk busy to every other member, its bytes never evictable, while a lived.

The key is now remembered and ``settle`` (the heartbeat) counts the value again while it is
still the one on the medium: a write since replaced it and counted its own, and a value gone
leaves only the lost reservation to release. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import failed_recount  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, one_chunk_cluster  # noqa: E402


def members(tmp_path, url, how, seed):
    prefix = f"rv-recount-fails-{how.split()[0]}-{seed}"  # each test its own keys and budget on the shared Redis
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, url, prefix, seed)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = 2 * BLOB - 1  # one chunk fits, not two
        cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    return key, value, ca, cb, raw, rkey


@pytest.mark.parametrize("how", ["unreachable", "reply lost", "release fails"])
def test_a_recount_that_failed_is_counted_again_by_the_heartbeat(tmp_path, redis_server, how):
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
    """The key had no entry: b's put wrote its blob over the older value and counted it."""
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
    """The entry was a's, pending: a's own next write took it over and committed its blob."""
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
    """Redis dropped the older value on its own: nothing is left to count."""
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, "reply lost", 139)
    with Store(ca) as a:
        tier = failed_recount(a, key, value, "reply lost")
        raw.delete(rkey)
        tier.settle()
        ledger = a.cluster.ledger
        state = (ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
    assert state == (None, 0), "the reservation whose reply was lost stayed after its value was gone"
