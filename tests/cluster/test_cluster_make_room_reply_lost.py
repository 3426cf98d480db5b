"""A MAKE_ROOM whose reply was lost is run again by redis-py's retry.

The first run marked its victims evicting and put them in this member's set of values to
delete; the member never learns them. The retry (same arguments) finds their bytes still
counted and chooses more victims. The first victims then stay "evicting" and counted for
as long as the member runs: their values stay on the medium uncounted-for-use, every
reservation of those chunks is answered "busy", and the budget is short by their bytes.
Real Redis; the lost reply is injected where redis-py reads it."""

import time

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import lose_reply_once, quick_retrying, settled  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402
from tiers.base import TierError  # noqa: E402

BLOB = 4224


@pytest.mark.parametrize("retry", ["retried", "retry fails too"])
def test_the_victims_of_a_make_room_whose_reply_was_lost_are_deleted_and_uncounted(tmp_path, redis_server, retry):
    keys, values = chunks(4, seed=61)
    ca = quick_retrying(redis_member(tmp_path, redis_server.url, "rv-room-lost-" + retry.split()[-1], "a"))
    ca.redis.capacity_bytes = 3 * BLOB
    raw = redis.Redis.from_url(redis_server.url)
    with Store(ca) as a:
        for k, v in zip(keys[:3], values[:3]):
            a.put(k, v, durable=True)
        armed = lose_reply_once(a.cluster.ledger, "make_room", unreachable_after=retry == "retry fails too")
        try:
            a.put(keys[3], values[3], durable=True)  # needs room: the oldest chunk is the victim
        except TierError:
            assert retry == "retry fails too"  # the ledger unreachable: the copy fails, honestly
        assert not armed[0]
        done = settled(a)
        usage = a.cluster.ledger.state(10.0).tiers["redis"]
        held = list(raw.scan_iter(match=ca.redis.key_prefix + "*"))
        evicted = 3 + raw.exists(ca.redis.key_prefix.encode() + keys[3].id.hex().encode()) - len(held)
    assert done, "the first run's victims stay 'evicting' in this member's set for good"
    assert usage.used_bytes == sum(raw.strlen(k) for k in held) and usage.chunks == len(held)
    assert evicted == 1, f"{evicted} chunks evicted to make room for one"
