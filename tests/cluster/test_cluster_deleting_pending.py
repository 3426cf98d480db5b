"""A delete that took another member's pending entry left the key in that member's in-flight
set too, so two members held one evicting entry.

Member w has reserved a chunk (pending, in w's set ``f:<tier>:w``) when d deletes it: d's
``deleting`` makes the entry evicting and puts the key in d's set, but before the fix left
it in w's. w is then reaped as dead (the reaper is handed the key from w's set) or restarts
(``join`` hands it to w's new run): that member deletes the value and its ``evicted`` drops
the entry while d is still deleting. x's durable put of the chunk is then granted, written
and committed (acknowledged), and d's delete removes x's value. Real Redis, the ledger's
scripts driven one call at a time, Redis values standing for the medium."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from kvstore.cluster.ledger import Ledger  # noqa: E402

TIER, BLOB, KEY = "redis", 4224, b"\x5a" * 32
BUDGETS = {TIER: 16 * BLOB}


@pytest.mark.parametrize("owner_goes", ["reaped", "restarted"])
def test_a_pending_entry_a_delete_takes_is_no_longer_its_writers_to_finish(redis_server, owner_goes):
    prefix = "deleting-pending-" + owner_goes + ":"
    raw = redis.Redis.from_url(redis_server.url)
    value = ("value:" + prefix).encode()
    ledger = Ledger(redis_server.url, prefix, False)
    try:
        for m in "wdrx":
            ledger.join(m, BUDGETS, {})
        assert ledger.reserve("w", TIER, KEY, BLOB, BLOB, 10.0)[0] == "ok"
        raw.set(value, b"w's bytes")  # w's write lands; w does not commit
        ledger.deleting("d", TIER, [KEY])  # d takes the entry; it deletes the value next
        if owner_goes == "reaped":
            raw.zadd(ledger.prefix + "beats", {"w": 0})  # w stopped beating long ago: it is dead
            finisher, handed = "r", ledger.beat("r", {}, 10.0, 3600.0)
        else:
            finisher, handed = "w", ledger.join("w", BUDGETS, {})
        if (TIER, KEY) in handed:  # w's unfinished write, as the finisher sees it: delete, then evicted
            raw.delete(value)
            ledger.evicted(finisher, TIER, [KEY])
        granted = ledger.reserve("x", TIER, KEY, BLOB, BLOB, 10.0)[0] == "ok"
        acknowledged = False
        if granted:  # x's durable put: write, commit, acknowledged
            raw.set(value, b"x's bytes")
            acknowledged = ledger.commit("x", TIER, KEY)
        raw.delete(value)  # d's delete goes on: the value under the key goes
        ledger.evicted("d", TIER, [KEY])
        on_medium = raw.exists(value)
        left = (ledger.holder(TIER, KEY), ledger.state(10.0).tiers[TIER].in_flight)
    finally:
        ledger.close()
    assert not acknowledged or on_medium, "x's acknowledged durable value was deleted by d's delete"
    assert (TIER, KEY) not in handed, f"the {owner_goes} writer was handed the entry d's delete holds"
    assert left == (None, 0), "d's delete left an entry, or a key in some member's in-flight set"
