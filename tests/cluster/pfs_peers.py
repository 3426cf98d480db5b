"""Two daemons on one PFS mount: one daemon's config, and two puts of one chunk that a
peer's blob cannot be told from by codec and size alone."""

from __future__ import annotations

import torch

from helpers import PAGE
from kvstore.codecs import get_codec
from kvstore.config import (
    DiskTierConfig, HostTierConfig, PfsTierConfig, SharedIndexConfig, StoreConfig, WriteBehindConfig)


def daemon(tmp_path, redis_url: str | None, codec: str, verify: bool = True) -> StoreConfig:
    """One daemon: its own host RAM, the shared PFS directory, the shared index (if a URL)."""
    return StoreConfig(
        host=HostTierConfig(capacity_bytes=64 * PAGE, page_bytes=PAGE, prefault=False),
        disk=DiskTierConfig(enabled=False),
        pfs=PfsTierConfig(enabled=True, path=str(tmp_path / "pfs"), capacity_bytes=1 << 22, verify_payload=verify),
        write_behind=WriteBehindConfig(max_pending_bytes=16 * PAGE),
        shared_index=SharedIndexConfig(enabled=redis_url is not None, url=redis_url or "redis://127.0.0.1:1/0",
                                       key_prefix="review-pfs:i:", reconnect_s=0.2),
        codec=codec,
    )


MIXED = get_codec("mixed75")


def another_ranking(keys):
    """The default ranking reversed: other rows keep their bits, as many of them."""
    return -MIXED.importance(keys)


def two_puts(kind: str, value: torch.Tensor):
    """(A's value, A's codec, B's value, B's codec): one codec, blobs of one size, other bytes."""
    if kind == "raw":
        other = value.clone()
        other.view(-1)[0] += 1
        return value, "raw", other, "raw"
    return value, MIXED, value, MIXED.with_importance(another_ranking)
