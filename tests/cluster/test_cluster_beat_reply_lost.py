"""A heartbeat whose reply was lost left a dead member's work evicting for good.

Member d reserves a chunk and dies. b's heartbeat reaps it: ``beat.lua`` turns the entry
evicting, moves the key from d's in-flight set to b's and hands it to b to delete. When that
reply is lost, redis-py runs the script again, and before the fix the second run found d's
set empty and answered nothing; where the retry failed too, the next beat answered nothing
either. The key stayed evicting in b's set while b lived: its bytes counted against the
budget for good, every member's reservation of it answered busy. Real Redis; the lost reply
is injected where redis-py reads it."""

import threading

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import lose_reply_once, quick_reaping  # noqa: E402
from faults import wait_until  # noqa: E402
from kvstore.cluster.ledger import Ledger  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import redis_member  # noqa: E402

KEY, BLOB = b"\x6b" * 32, 4224


@pytest.mark.parametrize("retry", ["retried", "retry fails too"])
def test_a_dead_members_write_handed_over_by_a_beat_whose_reply_was_lost_is_still_finished(tmp_path, redis_server,
                                                                                          retry):
    prefix = "rv-beat-lost-" + retry.split()[-1]
    cb = quick_reaping(redis_member(tmp_path, redis_server.url, prefix, "b"))
    raw = redis.Redis.from_url(redis_server.url)
    with Store(cb) as b:
        ledger = b.cluster.ledger
        beat = ledger.beat
        parked, go = threading.Event(), threading.Event()

        def held_beat(*args, **kwargs):  # b's next heartbeat waits here until d is dead
            parked.set()
            go.wait()
            return beat(*args, **kwargs)

        ledger.beat = held_beat
        assert parked.wait(10)
        d = Ledger(redis_server.url, cb.shared_index.key_prefix, False)
        try:
            d.join("d", {"redis": cb.redis.capacity_bytes}, {})
            assert d.reserve("d", "redis", KEY, BLOB, BLOB, 10.0)[0] == "ok"
        finally:
            d.close()
        raw.zadd(ledger.prefix + "beats", {"d": 0})  # d stopped beating long ago: it is dead
        lose_reply_once(ledger, "beat", unreachable_after=retry != "retried")
        ledger.beat = beat
        go.set()  # the held beat reaps d; its reply is lost

        def finished():
            usage = ledger.state(10.0).tiers["redis"]
            return ledger.holder("redis", KEY) is None and usage.in_flight == 0 and usage.used_bytes == 0
        wait_until(finished, timeout_s=5, what="b to finish d's unfinished write (its entry dropped, its bytes free)")
