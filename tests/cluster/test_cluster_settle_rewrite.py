"""The heartbeat's settle of a lost commit reply must not undo a newer write of the same key.

A write whose commit reply was lost (and whose retry failed too) leaves its key in
BudgetedTier._uncommitted; the heartbeat's ``settle`` commits it again. If the entry was
taken from this member meanwhile (a delete), that commit answers False and settle undoes the
old write: it asks the ledger for the entry, then deletes the value and releases the
reservation. A new write of the same key by this member, between that commit and the undo,
wrote and committed the same blob: the undo found this member holding the entry and the
value's header its own, deleted the value and released the new write's entry. The new write
had returned: acknowledged, then lost, and the ledger counted nothing. Real Redis."""

import threading

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from cluster_faults import lose_reply_once  # noqa: E402
from kvstore.blob import encode_header  # noqa: E402
from kvstore.codecs.raw import tensor_bytes  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, redis_member  # noqa: E402
from tiers.base import TierError  # noqa: E402


def test_a_settle_that_undoes_a_taken_write_keeps_a_newer_write_of_the_key(tmp_path, redis_server):
    keys, values = chunks(1, seed=53)
    key, value = keys[0], values[0]
    cfg = redis_member(tmp_path, redis_server.url, "rv-settle-rewrite", "a")
    cfg.cluster.heartbeat_s, cfg.cluster.member_ttl_s = 3600.0, 3 * 3600.0  # the test settles by hand
    raw = redis.Redis.from_url(redis_server.url)
    rkey = cfg.redis.key_prefix.encode() + key.id.hex().encode()
    payload = tensor_bytes(value)
    parts = [encode_header(key, 0, value.dtype, value.shape, payload), payload]
    with Store(cfg) as a:
        tier = a.cluster.tiers["redis"]
        ledger = a.cluster.ledger
        lose_reply_once(ledger, "commit", unreachable_after=True)
        with pytest.raises(TierError):
            tier.write(key.id, parts)  # the commit ran; its reply, and the retry's, were lost
        tier.delete(key.id)  # the entry is taken from this member: settle's commit answers False

        rewrite = threading.Thread(target=tier.write, args=(key.id, parts))
        real_undoing = ledger.undoing

        def undoing(*args):  # settle's undo asks the ledger for the entry: a new write ran first
            if not rewrite.is_alive() and rewrite.ident is None:
                rewrite.start()
                rewrite.join(1.0)  # with the fix it waits for the settle to end
            return real_undoing(*args)

        ledger.undoing = undoing
        tier.settle()
        rewrite.join(30)
        assert rewrite.ident is not None and not rewrite.is_alive()
        on_redis = raw.exists(rkey)
        usage = ledger.state(10.0).tiers["redis"]
        counted = (usage.chunks, usage.used_bytes)
        held = (1, raw.strlen(rkey)) if on_redis else (0, 0)
    assert on_redis == 1, "the settle's undo deleted the value a newer write of the key had written and committed"
    assert counted == held, "the ledger counts a value Redis does not hold"
