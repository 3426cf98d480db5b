"""Per-tenant quotas of host and disk bytes, enforced before a put is stored.

The ledger (kvstore/quota.py) knows each tenant's bytes per tier. A put that would take its
owner (the caller, or the shared tenant) over its host-RAM quota first makes room among that
owner's own chunks, oldest first: those already on disk leave host RAM only, the others are
deleted; over its disk quota, its oldest chunks on disk are deleted. So a tenant at its quota
replaces its own chunks and never pushes out anybody else's. Limits of the guarantee: puts of
one tenant in flight at once may overshoot by their sizes, reads that promote a chunk back
into host RAM count from then on (the next put makes room), and chunk sizes are blob bytes
(without the tiers' page or block rounding).
"""

from __future__ import annotations

import grpc

from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.keys import ChunkKey
from kvstore.quota import ReplicaUsage
from kvstore.store import Store

HOST, DISK = "host", "disk"


class Quotas:
    def __init__(self, store: Store, usage: ReplicaUsage) -> None:
        self.store, self.usage = store, usage
        self._disk = any(t.name == DISK for t in store.tiers)

    def make_room(self, owner: Tenant, key: ChunkKey, nbytes: int) -> None:
        """Before ``owner`` stores ``nbytes`` under ``key`` (an executor thread)."""
        self.usage.assign(key.namespace, owner.label)
        for tier, quota in ((HOST, owner.host_bytes), (DISK, owner.disk_bytes if self._disk else 0)):
            if not quota:
                continue
            # a re-put replaces the chunk's blob there: it adds only what it is larger by (before,
            # a re-put was never checked, and a tiny blob re-put large took any number of bytes)
            growth = nbytes - self.usage.held(tier, key.id)
            if growth <= 0:
                continue
            if nbytes > quota:
                raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"a chunk of {nbytes} bytes exceeds this tenant's {tier} quota of {quota} bytes")
            over = self.usage.used(owner.label, tier) + growth - quota
            if over > 0:
                self._evict(owner, tier, over, key)

    def _evict(self, owner: Tenant, tier: str, nbytes: int, keep: ChunkKey) -> None:
        victims = self.usage.oldest(owner.label, tier, nbytes, skip=frozenset({keep.id}))
        if tier == HOST and self._disk:
            on_disk = [k for k in victims if self.usage.holds(DISK, k.id)]
            self.store.drop(on_disk, HOST)
            victims = [k for k in victims if not self.usage.holds(DISK, k.id)]
        self.store.delete(victims)

    def used(self, owner: Tenant) -> dict[str, int]:
        return {tier: self.usage.used(owner.label, tier) for tier in (HOST, DISK)}
