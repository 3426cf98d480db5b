"""Presence checks: the ledger answers a reservation "present" when the key's resident entry
has the reserved size, and BudgetedTier's write then writes nothing. The unit promises that a
durable put told "present" is acknowledged only with its own blob on the medium: a value the
medium dropped on its own (a maxmemory policy) is written again, and another blob of the same
size (other payload bytes, another ranking of a mixed codec) is replaced, since the writer
compares the medium's header with its own. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

import redis  # noqa: E402

from kvstore.codecs import get_codec  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import chunks, one_chunk_cluster, redis_member  # noqa: E402

MIXED = get_codec("mixed75")


def another_ranking(keys):
    """The default ranking reversed: other rows keep their bits, as many of them."""
    return -MIXED.importance(keys)


@pytest.mark.parametrize("who", ["same member", "other member"])
def test_a_durable_put_the_ledger_calls_present_writes_a_value_redis_dropped(tmp_path, redis_server, who):
    """The bug: the ledger said 'present' of a value Redis had dropped: acknowledged with no copy (fixed in 0320d8c)."""
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


@pytest.mark.parametrize("kind", ["raw, low bits differ", "mixed75, another ranking"])
def test_a_durable_put_of_another_blob_of_the_same_size_is_written_and_read_back(tmp_path, redis_server, kind):
    """The bug: told 'present' for another blob of its size, b's put wrote nothing and b read a's (fixed in f672e0b)."""
    key, value, (ca, cb), raw, rkey = one_chunk_cluster(tmp_path, redis_server.url, "rv-present-" + kind[:3], 139)
    if kind.startswith("raw"):
        theirs, mine = dict(codec="raw"), dict(codec="raw")
        other = value.clone()
        other.view(-1)[0] += 1
    else:
        theirs, mine = dict(codec=MIXED), dict(codec=MIXED.with_importance(another_ranking))
        other = value
    with Store(ca) as a, Store(cb) as b:
        a.put(key, value, durable=True, **theirs)
        b.put(key, other, durable=True, **mine)  # acknowledged: "written and synced on every replica tier"
        blob, a_blob = b.get_blob(key), a.get_blob(key)  # from host RAM: the blobs each put
        assert blob != a_blob and len(blob) == len(a_blob), "not another blob of the same size"
        on_redis = raw.get(rkey)
        assert b.drop([key], "host") == 1  # b's index lists its Redis copy alone
        read = b.get_blob(key)
        holder = b.cluster.ledger.holder("redis", key.id)
    assert read in (blob, None), "b read another put's bytes as those of its last acknowledged put"
    assert on_redis == blob, "b's durable put was acknowledged with a's blob on Redis"
    assert holder == ("r", "b")
