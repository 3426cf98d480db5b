"""The ledger answered "present" for a value that the medium no longer held.

Redis may drop a value on its own (maxmemory eviction; tiers/redis.py says so), and a
durable put's copy to a shared tier therefore looks at the medium first and writes the value
again when it is gone (kvstore/store/write_behind.py ``_there``). In a cluster that write goes
through BudgetedTier.write, whose reservation the ledger answers "present" (its entry for
the chunk is resident, same size): the write returns without writing, and the durable put
is acknowledged with no copy on the tier. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402


@pytest.mark.parametrize("who", ["same member", "other member"])
def test_a_durable_put_the_ledger_calls_present_writes_a_value_redis_dropped(tmp_path, redis_server, who):
    keys, values = chunks(1, seed=31)
    prefix = f"rv-gone-{who.split()[0]}"
    ca = redis_member(tmp_path, redis_server.url, prefix, "a")
    cb = redis_member(tmp_path, redis_server.url, prefix, "b")
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + keys[0].id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        a.put(keys[0], values[0], durable=True)
        assert raw.exists(rkey)
        raw.delete(rkey)  # what a maxmemory policy does: the ledger still counts it resident
        putter = a if who == "same member" else b
        putter.put(keys[0], values[0], durable=True)  # acknowledged: "on every replica tier"
        on_redis = raw.exists(rkey)
        used = a.cluster.ledger.state(10.0).tiers["redis"].used_bytes
    assert on_redis == 1, "a durable put was acknowledged with no copy on Redis: the ledger said 'present'"
    assert used == raw.strlen(rkey)  # the ledger counts what Redis holds
