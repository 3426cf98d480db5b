"""A victim whose delete the lookup index could not be told of stayed evicting for good.

``BudgetedTier.remove`` deletes the values the ledger named (victims of ``make_room``, a dead
member's unfinished work, deletes to finish), tells the shared index they are gone, then
tells the ledger (``evicted``). The shared index is spread over the Redis Cluster's nodes,
the ledger sits on one of them: with the index unreachable for a moment, ``forget`` raised
before ``evicted``, and nothing remembered the values. Their entries stayed evicting in
this member's set while it lived: bytes counted for good, the chunks busy to every writer.
Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import quick_retrying  # noqa: E402
from faults import unlisting_fails_once, wait_until  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, chunks, redis_member  # noqa: E402
from tiers.base import TierError  # noqa: E402


def test_a_victim_deleted_while_the_lookup_index_was_unreachable_is_still_uncounted(tmp_path, redis_server):
    keys, values = chunks(3, seed=97)
    cfg = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-forget-fails"))
    cfg.redis.capacity_bytes = 2 * BLOB  # the cluster's budget: two chunks
    raw = redis.Redis.from_url(redis_server.url)
    rkey = cfg.redis.key_prefix.encode() + keys[0].id.hex().encode()
    with Store(cfg) as a:
        for k, v in zip(keys[:2], values[:2]):
            a.put(k, v, durable=True)
        failed = unlisting_fails_once(a.shared_index)
        try:
            a.put(keys[2], values[2], durable=True)  # the ledger has a evict the first chunk
        except TierError:
            pass  # the copy may fail with the index: what matters is the ledger after it
        assert [keys for _, keys in failed] == [[keys[0].id]] and not raw.exists(rkey), "the oldest chunk was evicted from Redis"
        ledger = a.cluster.ledger

        def uncounted():
            usage = ledger.state(10.0).tiers["redis"]
            return ledger.holder("redis", keys[0].id) is None and usage.in_flight == 0
        wait_until(uncounted, timeout_s=5, what="the evicted chunk's entry to be dropped (not left evicting)")
        assert a.shared_index.lookup([keys[0].id]) == {}, "the lookup index still lists the evicted chunk on Redis"
