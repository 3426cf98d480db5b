"""A ledger script that ran, whose reply was lost, is run again by redis-py's retry.

redis-py retries a command once on a fresh connection after a timeout or a dropped
connection (tiers/redis.py ``connect``: ``Retry(..., 1)``; TimeoutError is a supported
error). For COMMIT that is not harmless: the first run made the entry resident, the second
finds it resident and answers 0 ("taken from this member meanwhile"), and
BudgetedTier.write undoes its write: it deletes the value, while the ledger keeps counting
it resident. A member told "present" in between (its durable put acknowledged, writing
nothing) has lost its copy; and every later reservation of the chunk is answered "present"
for a value no tier holds. Real Redis; the lost reply is injected where redis-py reads it."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import lose_reply_once  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402


@pytest.mark.parametrize("retry", ["retried", "retry fails too"])
def test_a_commit_whose_reply_was_lost_keeps_the_value_another_member_was_told_is_there(tmp_path, redis_server, retry):
    keys, values = chunks(1, seed=41)
    key, value = keys[0], values[0]
    prefix = "rv-commit-lost-" + retry.split()[-1]
    ca = redis_member(tmp_path, redis_server.url, prefix, "a")
    cb = redis_member(tmp_path, redis_server.url, prefix, "b")
    raw = redis.Redis.from_url(redis_server.url)
    rkey = ca.redis.key_prefix.encode() + key.id.hex().encode()
    with Store(ca) as a, Store(cb) as b:
        acked = []

        def b_puts_it_meanwhile():  # a's commit ran: the entry is resident, the value is on Redis
            b.put(key, value, durable=True)  # the ledger says "present": acknowledged, nothing written
            acked.append(raw.exists(rkey))

        armed = lose_reply_once(a.cluster.ledger, "commit", b_puts_it_meanwhile, retry == "retry fails too")
        try:
            a.put(key, value, durable=True)
        except Exception:
            pass  # a's own put may fail: its outcome is not what this test is about
        assert not armed[0] and acked == [1], "b's durable put ran while a's commit reply was lost"
        on_redis = raw.exists(rkey)
        usage = a.cluster.ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "b's acknowledged durable put has no copy: a's undo deleted the value after a retried commit"
    assert counted == held, "the ledger counts a value Redis does not hold"
