"""Building the tiers and the shared index a StoreConfig describes.

Tiers come fastest first: host RAM (always, and always first: puts land there), GPU,
local disk, PFS, Redis. A GPU tier without CUDA is left out with one log line. Redis may be
down at start: its tier and the shared index are then built on first use and retried, so
the store starts without them and picks them up when Redis returns.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Sequence

from kvstore.config import StoreConfig, format_size
from tiers.base import Tier, TierError, TierUnavailable
from tiers.host import HostTier
from tiers.files import TMP_SUFFIX
from tiers.disk import HASH_SLICE_BYTES, DiskTier
from tiers.read_probe import read_form
from tiers.reconnecting import ReconnectingTier
from tiers.throttle import ThrottledTier

log = logging.getLogger(__name__)

# A shared tier's own capacity in a cluster: the cluster's budget (kvstore/cluster/budgeted_tier.py)
# is the one that counts, not this daemon's view of the medium.
UNBOUNDED = 1 << 62


@dataclass
class TierSetup:
    tier: Tier
    fetch_workers: int = 4
    verify_payload: bool = True


def _capped(tier: Tier, bytes_per_s: int) -> Tier:
    return ThrottledTier(tier, bytes_per_s) if bytes_per_s else tier


def check_host_capacity(capacity_bytes: int) -> None:
    """Refuse at once a host pool larger than physical memory: it cannot be prefaulted, and
    building its page table alone takes seconds before the allocation fails."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if capacity_bytes > physical:
        raise TierUnavailable(f"host: capacity {format_size(capacity_bytes)} is more than this machine's "
                              f"physical memory ({format_size(physical)})")


def build_tiers(config: StoreConfig) -> list[TierSetup]:
    h = config.host
    check_host_capacity(h.capacity_bytes)
    setups = [TierSetup(HostTier(h.capacity_bytes, h.page_bytes, h.prefault, h.shm_path), h.fetch_workers, h.verify_payload)]
    g = config.gpu
    if g.enabled:
        from tiers.gpu import GpuTier

        try:
            setups.append(TierSetup(GpuTier(g.capacity_bytes, g.page_bytes, g.device), g.fetch_workers, True))
        except TierUnavailable as exc:
            log.warning("gpu tier disabled: %s", exc)
    d = config.disk
    if d.enabled:
        disk = DiskTier(d.path, d.capacity_bytes, d.fsync, d.o_direct is True, d.read_threads,
                        direct_writes=d.direct_writes)
        workers = d.fetch_workers
        if d.o_direct == "auto" or not workers:  # measured: the form and reads in flight the device serves best
            direct, measured = read_form(str(disk.root), None if d.o_direct == "auto" else disk.o_direct,
                                         TMP_SUFFIX, HASH_SLICE_BYTES)
            disk.o_direct = direct and hasattr(os, "O_DIRECT")
            workers = workers or measured
        setups.append(TierSetup(_capped(disk, d.read_bytes_per_s), workers, d.verify_payload))
    p = config.pfs
    if p.enabled:
        if not p.path:
            raise ValueError("pfs.path must be set when the pfs tier is enabled")
        from tiers.pfs import PfsTier

        from kvstore.cluster.member import check_pfs_marker

        pfs = PfsTier(p.path, UNBOUNDED if config.cluster.enabled else p.capacity_bytes, p.read_threads, p.fsync)
        try:
            check_pfs_marker(config, pfs.root)
        except BaseException:
            pfs.close()
            raise
        setups.append(TierSetup(_capped(pfs, p.read_bytes_per_s), p.fetch_workers, p.verify_payload))
    r = config.redis
    if r.enabled:
        from tiers.redis import RedisTier

        capacity = UNBOUNDED if config.cluster.enabled else r.capacity_bytes

        def connect_redis() -> Tier:
            tier = RedisTier(r.url, capacity, r.key_prefix, r.cluster, r.socket_timeout_s,
                             r.connect_timeout_s, r.max_connections)
            return _capped(tier, r.read_bytes_per_s)

        setups.append(TierSetup(ReconnectingTier("redis", capacity, connect_redis, shared=True, retry_s=r.reconnect_s), r.fetch_workers, r.verify_payload))
    return setups


def budgets(config: StoreConfig) -> dict[str, int]:
    """The cluster-wide budget of each configured shared tier."""
    return {"pfs": config.pfs.capacity_bytes, "redis": config.redis.capacity_bytes}


class SharedIndexClient:
    """The shared index, connected on first use and retried while Redis is down or refuses us.

    Every call is best effort: with Redis unreachable, lookups find nothing extra and
    updates are skipped (counted in ``errors``); the local index keeps working.
    """

    def __init__(self, config: StoreConfig) -> None:
        self._config = config.shared_index
        self._retry_s = config.shared_index.reconnect_s
        self._index = None
        self._next_try = 0.0
        self._lock = threading.Lock()
        self.errors = 0

    def _get(self):
        if self._index is not None:
            return self._index
        with self._lock:
            if self._index is None and time.monotonic() >= self._next_try:
                from kvstore.cluster.shared_index import SharedIndex

                c = self._config
                try:
                    self._index = SharedIndex(c.url, c.key_prefix, c.cluster, c.socket_timeout_s)
                except TierError as exc:  # down, or refusing us (a wrong password): retried the same
                    self._next_try = time.monotonic() + self._retry_s
                    log.warning("shared index unavailable, retrying every %.0f s: %s", self._retry_s, exc)
        return self._index

    def _call(self, what: str, fn, default):
        index = self._get()
        if index is None:
            return default
        try:
            return fn(index)
        except TierError as exc:
            self.errors += 1
            log.warning("shared index %s failed: %s", what, exc)
            return default

    def add(self, tier_name: str, key_ids: Sequence[bytes], sizes: Sequence[int]) -> None:
        self._call("add", lambda i: i.add(tier_name, key_ids, sizes), None)

    def remove(self, tier_name: str, key_ids: Sequence[bytes]) -> None:
        self._call("remove", lambda i: i.remove(tier_name, key_ids), None)

    def lookup(self, key_ids: Sequence[bytes]) -> dict[bytes, dict[str, int]]:
        return self._call("lookup", lambda i: i.lookup(key_ids), {})

    def close(self) -> None:
        if self._index is not None:
            self._index.close()
