"""A durable put told "present" for another blob of the chunk, of the same size, wrote nothing.

The ledger answers a reservation "present" when the key's resident entry has the reserved
size; BudgetedTier._write then checked only that the medium held some value. A blob of the
same size can be another put's: the same codec with other payload bytes (a mixed codec with
its own ranking, ``with_importance``; KV computed apart, its low bits differing). Before the
fix b's durable put was acknowledged while Redis kept a's blob, b's index listed the Redis
copy as its own (the codec matches, so its read compares no more), and once b's host copy
was gone b's read returned a's bytes, not those of its last acknowledged put. The writer now
compares the medium's header with its own and otherwise writes its blob, as one of another
size would replace it. Real Redis."""

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from kvstore.codecs import get_codec  # noqa: E402
from kvstore.store import Store  # noqa: E402
from shared_tiers import one_chunk_cluster  # noqa: E402

MIXED = get_codec("mixed75")


def another_ranking(keys):
    """The default ranking reversed: other rows keep their bits, as many of them."""
    return -MIXED.importance(keys)


@pytest.mark.parametrize("kind", ["raw, low bits differ", "mixed75, another ranking"])
def test_a_durable_put_of_another_blob_of_the_same_size_is_written_and_read_back(tmp_path, redis_server, kind):
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
