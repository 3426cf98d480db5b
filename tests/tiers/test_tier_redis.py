import itertools
import time

import numpy as np
import pytest
import torch

pytest.importorskip("redis", reason="redis-py is not installed (the redis extra)")

from kvstore.config import DiskTierConfig, HostTierConfig, StoreConfig
from kvstore.keys import Namespace, chunk_keys
from kvstore.store import Store
from tiers.base import TierError, TierFull, TierUnavailable
from tiers.redis import RedisTier

_prefixes = itertools.count()


def blob(n, seed):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def prefix() -> str:
    """A fresh key prefix, so tests sharing a server do not see each other's values."""
    return f"t{next(_prefixes)}:"


def test_round_trip_scatter_read_and_view(redis_server):
    tier = RedisTier(redis_server.url, 1 << 20, key_prefix=prefix())
    data = blob(10_000, 1)
    tier.write(key(1), [data[:100], memoryview(data)[100:5000], np.frombuffer(data[5000:], np.uint8)])
    head, rest = bytearray(100), bytearray(len(data) - 100)
    assert tier.read_into(key(1), [memoryview(head), memoryview(rest)]) == len(data)
    assert bytes(head + rest) == data
    assert tier.read(key(1)) == data
    assert tier.size_of(key(1)) == len(data) and tier.contains(key(1))
    assert tier.used_bytes == len(data) and len(tier) == 1
    with pytest.raises(ValueError, match="too small"):
        tier.read_into(key(1), bytearray(10))
    assert tier.read(key(2)) is None and tier.read_into(key(2), bytearray(1)) is None
    assert not tier.contains(key(2))
    tier.write(key(1), [b"short"])
    assert tier.read(key(1)) == b"short" and tier.used_bytes == 5
    assert tier.delete(key(1)) and not tier.delete(key(1))
    assert tier.used_bytes == 0 and tier.read(key(1)) is None
    tier.close()


def test_capacity_budget_raises_tier_full(redis_server):
    tier = RedisTier(redis_server.url, 10_000, key_prefix=prefix())
    tier.write(key(1), [b"a" * 6000])
    with pytest.raises(TierFull):
        tier.write(key(2), [b"b" * 6000])
    tier.write(key(1), [b"c" * 9000])  # a replacement only needs the difference
    assert tier.used_bytes == 9000 and tier.read(key(2)) is None


def test_pipelined_batches(redis_server):
    tier = RedisTier(redis_server.url, 1 << 24, key_prefix=prefix())
    items = [(key(i), [blob(1000 + i, i)[:10], blob(1000 + i, i)[10:]]) for i in range(50)]
    tier.write_many(items)
    assert tier.used_bytes == sum(1000 + i for i in range(50))
    got = tier.read_many([key(i) for i in range(55)])
    assert got[:50] == [blob(1000 + i, i) for i in range(50)] and got[50:] == [None] * 5
    outs = [bytearray(2000) for _ in range(3)]
    assert tier.read_many_into([key(0), key(99), key(2)], outs) == [1000, None, 1002]
    assert bytes(outs[2][:1002]) == blob(1002, 2)
    with pytest.raises(TierFull):
        tier.write_many([(key(100 + i), [b"x" * (1 << 20)]) for i in range(20)])
    assert tier.read(key(100)) is None  # the budget is checked before anything is sent


def test_other_daemons_values_are_found_and_listed(redis_server):
    p = prefix()
    writer = RedisTier(redis_server.url, 1 << 20, key_prefix=p)
    reader = RedisTier(redis_server.url, 1 << 20, key_prefix=p)
    other_ns = RedisTier(redis_server.url, 1 << 20, key_prefix=p + "x:")
    writer.write(key(7), [b"seven" * 100])
    other_ns.write(key(8), [b"eight"])
    assert reader.contains(key(7)) and reader.size_of(key(7)) == 500
    assert reader.read(key(7)) == b"seven" * 100
    assert not reader.contains(key(8))
    fresh = RedisTier(redis_server.url, 1 << 20, key_prefix=p)
    assert list(fresh.keys()) == [key(7)] and fresh.used_bytes == 500
    writer.delete(key(7))
    assert reader.read_into(key(7), bytearray(500)) is None  # stale view: a clean miss
    assert not reader.contains(key(7)) and reader.used_bytes == 0


def test_eviction_by_redis_is_a_clean_miss(own_redis_server):
    own_redis_server.cli("CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
    used = int(own_redis_server.cli("INFO", "memory").split("used_memory:")[1].split()[0])
    own_redis_server.cli("CONFIG", "SET", "maxmemory", str(used + (2 << 20)))
    tier = RedisTier(own_redis_server.url, 1 << 30)
    for i in range(20):
        tier.write(key(i), [blob(200_000, i)])
    assert len(tier) == 20  # the view still lists every value
    present = 0
    for i in range(20):
        out = bytearray(200_000)
        got = tier.read_into(key(i), out)
        if got is None:
            assert not tier.contains(key(i))
        else:
            assert got == 200_000 and bytes(out) == blob(200_000, i)
            present += 1
    assert 0 < present < 20
    assert len(tier) == present and tier.used_bytes == present * 200_000


def test_server_out_of_memory_is_tier_full(own_redis_server):
    own_redis_server.cli("CONFIG", "SET", "maxmemory-policy", "noeviction")
    used = int(own_redis_server.cli("INFO", "memory").split("used_memory:")[1].split()[0])
    own_redis_server.cli("CONFIG", "SET", "maxmemory", str(used + (1 << 20)))
    tier = RedisTier(own_redis_server.url, 1 << 30)
    with pytest.raises(TierFull, match="out of memory"):
        for i in range(20):
            tier.write(key(i), [blob(200_000, i)])
    assert tier.read(key(0)) == blob(200_000, 0)


def test_server_down_raises_unavailable_then_recovers(own_redis_server):
    tier = RedisTier(own_redis_server.url, 1 << 20, socket_timeout_s=1.0, connect_timeout_s=0.5)
    tier.write(key(1), [b"before"])
    own_redis_server.stop()
    with pytest.raises(TierUnavailable, match="unreachable"):
        tier.read(key(1))
    with pytest.raises(TierUnavailable):
        tier.write(key(2), [b"during"])
    with pytest.raises(TierUnavailable):
        tier.read_many([key(1), key(2)])
    own_redis_server.start()  # same port, empty: the old value is gone
    assert tier.read(key(1)) is None
    tier.write(key(2), [b"after"])
    assert tier.read(key(2)) == b"after"


def test_unreachable_server_at_start_is_a_clear_error(own_redis_server):
    url = own_redis_server.url
    own_redis_server.stop()
    with pytest.raises(TierUnavailable, match="cannot reach Redis"):
        RedisTier(url, 1 << 20, connect_timeout_s=0.5)


def limited_user(server, name: str, rules: str) -> str:
    """A URL for a new ACL user, password ``pw``, with ``rules`` after every command on every key."""
    server.cli("ACL", "SETUSER", name, "reset", "on", ">pw", "~*", "+@all", *rules.split())
    return f"redis://{name}:pw@127.0.0.1:{server.port}/0"


@pytest.mark.parametrize("refusal", ["wrong password", "no PING"])
def test_a_server_refusing_the_client_at_start_is_a_tier_error_not_an_outage(redis_server, refusal):
    """A wrong password was "cannot reach Redis" (retried for ever, as if the server were
    down), and an ACL without PING escaped as redis-py's own NoPermissionError."""
    url = limited_user(redis_server, "noping", "-ping")
    if refusal == "wrong password":
        url = url.replace(":pw@", ":wrong@")
    with pytest.raises(TierError, match="refuses this client") as raised:
        RedisTier(url, 1 << 20)
    assert not isinstance(raised.value, TierUnavailable)


def test_an_unreachable_server_is_reported_without_its_password(own_redis_server):
    """The message lands in logs and on the console; the password would open every chunk."""
    port = own_redis_server.url.rsplit(":", 1)[1].split("/")[0]
    own_redis_server.stop()
    url = f"redis://kv:s3cret-pw@127.0.0.1:{port}/0?password=s3cret-q"
    with pytest.raises(TierUnavailable, match="cannot reach Redis") as caught:
        RedisTier(url, 1 << 20, connect_timeout_s=0.5)
    assert "s3cret" not in str(caught.value)
    assert f"kv:***@127.0.0.1:{port}" in str(caught.value)


def test_cluster_round_trip_across_slots(redis_cluster):
    url = redis_cluster[0].url
    tier = RedisTier(url, 1 << 24, key_prefix=prefix(), cluster=True)
    for i in range(30):
        tier.write(key(i), [blob(3000, i)])
    tier.write_many([(key(100 + i), [blob(2000, 100 + i)]) for i in range(30)])
    counts = [int(s.cli("DBSIZE")) for s in redis_cluster]
    assert all(c > 0 for c in counts)  # the values are spread over every node
    assert tier.read_many([key(i) for i in range(30)]) == [blob(3000, i) for i in range(30)]
    assert tier.read(key(105)) == blob(2000, 105)
    other = RedisTier(url, 1 << 24, key_prefix=tier.key_prefix, cluster=True)
    assert sorted(other.keys()) == sorted([key(i) for i in range(30)] + [key(100 + i) for i in range(30)])
    assert other.used_bytes == 30 * 3000 + 30 * 2000
    assert other.delete(key(3)) and tier.read_into(key(3), bytearray(3000)) is None


def test_a_second_store_on_the_server_serves_what_the_first_stored(redis_server):
    ns = Namespace("m", num_layers=2, num_kv_heads=2, head_dim=8, chunk_tokens=8)
    keys = chunk_keys(list(range(5 * ns.chunk_tokens)), ns)
    values = [torch.randn(ns.chunk_shape).to(torch.float16) for _ in keys]
    config = StoreConfig(host=HostTierConfig(capacity_bytes=1 << 20, page_bytes=4096, prefault=False),
                         disk=DiskTierConfig(enabled=False))
    p = prefix()
    with Store(config, extra_tiers=[RedisTier(redis_server.url, 1 << 20, key_prefix=p)]) as first:
        for k, v in zip(keys, values):
            first.put(k, v, durable=True)
        first.tiers[1].delete(keys[4].id)  # as if Redis had evicted it
    with Store(config, extra_tiers=[RedisTier(redis_server.url, 1 << 20, key_prefix=p)]) as second:
        assert second.lookup(keys) == 4  # recovered from a SCAN of the prefix
        redis_server.cli("DEL", f"{p}{keys[3].id.hex()}")  # evicted by Redis behind the view's back
        got = second.get(keys)
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(got, values))
        assert second.stats().tiers["redis"].errors == 0


def test_cluster_node_down_raises_unavailable_then_recovers(own_redis_cluster):
    tier = RedisTier(own_redis_cluster[0].url, 1 << 20, cluster=True, socket_timeout_s=1.0, connect_timeout_s=0.5)
    keys = [key(i) for i in range(20)]
    tier.write_many([(k, [b"v" * 100]) for k in keys])
    own_redis_cluster[1].stop()
    with pytest.raises(TierUnavailable, match="unreachable"):
        tier.read_many(keys)  # some of the keys live on the dead node
    own_redis_cluster[1].start()  # same port and node id; its values are gone
    deadline = time.monotonic() + 30
    while True:  # the cluster takes a moment to accept the node again
        try:
            got = tier.read_many(keys)
            break
        except TierUnavailable:
            assert time.monotonic() < deadline, "cluster did not recover"
            time.sleep(0.2)
    assert 0 < sum(v == b"v" * 100 for v in got) < 20 and all(v in (None, b"v" * 100) for v in got)
