import itertools

import pytest

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from kvstore.cluster.shared_index import SharedIndex
from tiers.base import TierUnavailable

_prefixes = itertools.count()


def key(ns: int, i: int) -> bytes:
    """A 32-byte id: a 16-byte namespace fingerprint, then a 16-byte prefix hash."""
    return ns.to_bytes(16, "big") + i.to_bytes(16, "big")


def check_index_behaviour(url: str, cluster: bool) -> None:
    p = f"idx{next(_prefixes)}:"
    a = SharedIndex(url, key_prefix=p, cluster=cluster)
    b = SharedIndex(url, key_prefix=p, cluster=cluster)  # another daemon
    chain = [key(1, i) for i in range(40)]
    a.add("pfs", chain[:30], [1000 + i for i in range(30)])
    b.add("redis", chain[10:20], [500] * 10)
    found = b.lookup(chain)
    assert set(found) == set(chain[:30])
    assert found[chain[0]] == {"pfs": 1000}
    assert found[chain[15]] == {"pfs": 1015, "redis": 500}
    assert b.longest_prefix(chain) == 30
    assert a.longest_prefix(chain[30:]) == 0
    assert a.longest_prefix([key(2, i) for i in range(5)]) == 0  # another namespace
    a.remove("pfs", chain[10:15])
    assert b.longest_prefix(chain) == 30  # chunks 10..14 are still in redis
    assert b.lookup([chain[12], chain[7]]) == {chain[12]: {"redis": 500}, chain[7]: {"pfs": 1007}}
    b.remove("redis", chain[10:20])
    assert a.longest_prefix(chain) == 10
    assert a.lookup([]) == {} and a.longest_prefix([]) == 0
    with pytest.raises(ValueError):
        a.add("pfs", chain[:2], [1])
    a.close()
    b.close()


def test_standalone(redis_server):
    check_index_behaviour(redis_server.url, cluster=False)


def test_cluster_across_slots(redis_cluster):
    check_index_behaviour(redis_cluster[0].url, cluster=True)
    assert all(int(s.cli("DBSIZE")) > 0 for s in redis_cluster)


def test_redis_down_raises_unavailable_then_recovers(own_redis_server):
    index = SharedIndex(own_redis_server.url, socket_timeout_s=1.0, connect_timeout_s=0.5)
    index.add("pfs", [key(1, 1)], [10])
    own_redis_server.stop()
    with pytest.raises(TierUnavailable, match="shared index"):
        index.lookup([key(1, 1)])
    with pytest.raises(TierUnavailable):
        index.add("pfs", [key(1, 2)], [10])
    own_redis_server.start()
    assert index.longest_prefix([key(1, 1)]) == 0  # restarted empty
    index.add("pfs", [key(1, 1)], [10])
    assert index.lookup([key(1, 1)]) == {key(1, 1): {"pfs": 10}}
