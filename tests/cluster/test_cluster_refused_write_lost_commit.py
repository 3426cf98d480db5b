"""A write refused by the ledger keeps the failed commit of an earlier write of its key.

a's put of a chunk (int8) wrote its value and its commit failed (the ledger unreachable:
it did not run, or its reply was lost): the entry stayed a's, pending, remembered in
``_uncommitted`` for the heartbeat to commit again. a's next write of the chunk (raw,
bigger: a re-put in another codec whose make_room passed on a count gone stale; here
written straight to the tier) popped that as it started ("its own commit decides"), and
the reserve answered full, leaving the entry as it was: nothing remembered it any more.
The chunk stayed pending, busy to every other member (b's durable put failed), its bytes
counted and never evictable, for as long as a lived. A write that ends without having
taken the entry over (full, or given up on busy) now puts the failed commit back, and the
heartbeat commits it as before. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from cluster_faults import CommitFailsOnce  # noqa: E402
from kvstore.blob import encode_header  # noqa: E402
from kvstore.codecs import resolve_codec  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import BLOB, one_chunk_cluster  # noqa: E402
from tiers.base import TierError, TierFull  # noqa: E402


def test_a_write_refused_full_leaves_the_lost_commit_to_the_heartbeat(tmp_path, redis_server):
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-refused-lost-commit", 163)
    for cfg in (ca, cb):
        cfg.redis.capacity_bytes = BLOB - 1  # the int8 blob fits, the raw one does not
        cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    cb.cluster.busy_wait_s = 1.0
    payload = resolve_codec("raw").encode(value)
    bigger = encode_header(key, resolve_codec("raw").codec_id, value.dtype, value.shape, payload) + bytes(payload)
    with Store(ca) as a, Store(cb) as b:
        tier = a.tier("redis")
        tier.ledger = failing = CommitFailsOnce(tier.ledger)
        with pytest.raises(TierError):
            a.put(key, value, codec="int8", durable=True)
        assert failing.failed
        there = raw.get(rkey)
        with pytest.raises(TierFull):
            tier.write(key.id, [bigger])
        tier.settle()  # the heartbeat
        ledger = b.cluster.ledger
        settled = (raw.get(rkey) == there, ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
        assert settled == (True, ("r", "a"), len(there)), "a's failed commit is forgotten: the entry stays pending"
        b.put(key, value, codec="int8", durable=True)  # busy to b for as long as a lived, before
        assert raw.get(rkey) == b.get_blob(key) == there
        b.tier("redis").make_room(BLOB - 1)  # the whole budget: a's value was never evictable, before
        evicted = (raw.exists(rkey), ledger.holder("redis", key.id), ledger.state(10.0).tiers["redis"].used_bytes)
        assert evicted == (0, None, 0)
