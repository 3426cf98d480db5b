"""Set-ups for stores on shared tiers (a PFS directory, Redis) as several daemons or cluster
members use them: their configs, a namespace of 4 KiB fp16 chunks and chunks in it."""

import redis
import torch

from helpers import PAGE
from kvstore.config import (
    DiskTierConfig,
    HostTierConfig,
    PfsTierConfig,
    RedisTierConfig,
    SharedIndexConfig,
    StoreConfig,
    WriteBehindConfig,
)
from kvstore.keys import Namespace, chunk_keys

SHARED_NS = Namespace("shared-test", num_layers=2, num_kv_heads=2, head_dim=16, chunk_tokens=16)  # 4 KiB fp16
BLOB = 4224  # one chunk's blob: 128-byte header + 4096 bytes of fp16


def daemon_config(tmp_path, name, redis_url=None, shared_index=True, prefix="t", pfs=True) -> StoreConfig:
    """One daemon's store: its own host RAM and local disk, the shared PFS directory and Redis."""
    cfg = StoreConfig(
        host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(path=str(tmp_path / name / "disk"), capacity_bytes=1 << 22),
        pfs=PfsTierConfig(enabled=pfs, path=str(tmp_path / "pfs"), capacity_bytes=1 << 22),
        write_behind=WriteBehindConfig(max_pending_bytes=16 * PAGE),
    )
    if redis_url:
        cfg.redis = RedisTierConfig(enabled=True, url=redis_url, key_prefix=f"{prefix}:v:", capacity_bytes=1 << 22,
                                    reconnect_s=0.2)
        cfg.shared_index = SharedIndexConfig(enabled=shared_index, url=redis_url, key_prefix=f"{prefix}:i:",
                                             reconnect_s=0.2)
    return cfg


def chunks(n, seed=0):
    """``n`` keys of one prefix in SHARED_NS and a random chunk for each."""
    gen = torch.Generator().manual_seed(seed)
    keys = chunk_keys(torch.randint(0, 9999, (n * SHARED_NS.chunk_tokens,), generator=gen).tolist(), SHARED_NS)
    return keys, [torch.randn(SHARED_NS.chunk_shape, generator=gen).half() for _ in keys]


def redis_member(tmp_path, url, prefix, name="a"):
    """Cluster member ``name``'s config: host RAM, then Redis as its durable replica tier."""
    cfg = daemon_config(tmp_path, name, url, True, prefix, pfs=False)
    cfg.disk.enabled = False
    cfg.cluster.enabled = True
    cfg.cluster.member = name
    return cfg


def one_chunk_cluster(tmp_path, url, prefix, seed, names="ab"):
    """One chunk (key, value), the configs of members ``names`` of one cluster on ``url``, a
    plain Redis client, and the chunk's key on Redis."""
    keys, values = chunks(1, seed=seed)
    members = [redis_member(tmp_path, url, prefix, name) for name in names]
    rkey = members[0].redis.key_prefix.encode() + keys[0].id.hex().encode()
    return keys[0], values[0], members, redis.Redis.from_url(url), rkey
