"""The heartbeat's release of a failed write's reservation ran beside a newer write of the key.

Member a's copy of a re-put (another codec) fails before it lands and BudgetedTier._undo
cannot release a's reservation (the ledger unreachable): the key stays in ``_owed``, and
the heartbeat's ``settle`` releases a's own pending entry. That release ran outside the
ordering of settles against writes of the same key (``_settle_keys``): a new write of the
key by a, in flight, had taken the pending entry over; the release dropped it, the write's
commit answered 0, its undo deleted the value just written (the chunk left with no copy on
Redis, the older value replaced) and the write failed for nothing.
``_owed`` is now settled under that ordering: a key being written is left for the next beat.
Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from faults import Call, Gate  # noqa: E402
from kvstore.store import Store  # noqa: E402
from test_cluster_recount_fails import failed_recount  # noqa: E402
from test_store_shared_durable import BLOB, one_chunk_cluster  # noqa: E402


def members(tmp_path, url, prefix, seed):
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, url, prefix, seed)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = 2 * BLOB - 1  # one chunk fits, not two
        cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    return key, value, ca, cb, raw, rkey


def test_the_heartbeat_leaves_a_later_write_of_the_key_in_flight(tmp_path, redis_server):
    key, value, ca, cb, raw, rkey = members(tmp_path, redis_server.url, "rv-owed-in-flight", 149)
    with Store(ca) as a:
        tier = failed_recount(a, key, value, "release fails")  # a's int8 reservation stays pending
        ours = a.get_blob(key)  # the re-put's int8 blob, in a's host RAM
        wrote = Gate(key.id)
        tier.inner.gates["write"] = wrote
        writing = Call(lambda: tier.write(key.id, [ours]))  # takes over a's pending entry
        assert wrote.entered.wait(10)
        tier.settle()  # the heartbeat, while the write is held before its value lands
        wrote.open()
        writing.join(30)
        assert writing.error is None, f"a's write of the key failed for nothing: {writing.error}"
        tier.settle()  # the next beat
        ledger = a.cluster.ledger
        state = (raw.get(rkey) == ours, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
    assert state == (True, ("r", "a"), len(ours)), "a's write is not what Redis holds and the ledger counts"
