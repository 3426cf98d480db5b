"""Dropping a 0-byte entry failed the whole ledger script.

A delete or an undo of a key the ledger has no entry for takes a 0-byte evicting one
(``e 0 0 <member>``, ``deleting.lua``, ``undoing.lua``). ``evicted`` then dropped it with a byte
count of -fp, which Lua writes as "-0", no integer to HINCRBY: the script failed after it
had dropped that entry, before the keys after it in the call. Every such delete raised
(logged as a failed delete), and the other entries of the call stayed evicting, their keys
busy to every member and their bytes counted, until a heartbeat settled them. Real Redis,
the ledger's scripts driven one call at a time."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from kvstore.cluster.ledger import Ledger  # noqa: E402

TIER, BLOB = "redis", 4224
LOST, HELD = b"\x01" * 32, b"\x02" * 32


def test_evicted_drops_an_entry_of_no_bytes_and_the_entries_after_it(redis_server):
    ledger = Ledger(redis_server.url, "empty-entry:", False)
    try:
        ledger.join("a", {TIER: 16 * BLOB}, {})
        assert ledger.reserve("a", TIER, HELD, BLOB, BLOB, 10.0)[0] == "ok"
        assert ledger.commit("a", TIER, HELD)
        ledger.deleting("a", TIER, [LOST, HELD])  # LOST has no entry: it gets one of 0 bytes
        used = ledger.evicted("a", TIER, [LOST, HELD])  # both values are gone
        left = (ledger.holder(TIER, LOST), ledger.holder(TIER, HELD), ledger.state(10.0).tiers[TIER].in_flight)
    finally:
        ledger.close()
    assert (used, left) == (0, (None, None, 0)), "evicted left an entry, or a key in the member's in-flight set"
