"""Per-tenant quotas of host and disk bytes, enforced before a put is stored and after reads
that promote chunks into host RAM.

The ledger (kvstore/store/quota.py) knows each tenant's bytes per tier, as the tiers hold them
(host-RAM pages, disk blocks: not blob bytes, which let a tenant of tiny chunks hold far more
than its quota). A put that would take its owner (the caller, or the shared tenant) over its
host-RAM quota first makes room among that owner's own chunks, oldest first: those already on
disk leave host RAM only, the others are deleted; over its disk quota, its oldest chunks on
disk are deleted. A read or prefetch that promoted a tenant's chunks into host RAM is followed
by the same (``enforce``): before, promotions counted but nothing made room, and a tenant
read its disk chunks back and pinned them until other tenants' puts were refused. So a
tenant at its quota replaces its own chunks and never pushes out anybody else's, and what it
pins in host RAM is within its quota. Limits of the guarantee: puts and reads of one tenant
in flight at once may overshoot by their sizes until they end, and a chunk whose copy waits
on a stalled replica tier stays in host RAM (its copy's source) until the tier moves again.
"""

from __future__ import annotations

import grpc

from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.keys import ChunkKey
from kvstore.store.quota import ReplicaUsage
from kvstore.store import Store

HOST, DISK = "host", "disk"


class Quotas:
    def __init__(self, store: Store, usage: ReplicaUsage) -> None:
        self.store, self.usage = store, usage
        self._disk = any(t.name == DISK for t in store.tiers)
        usage.measure({t.name: t.footprint for t in store.tiers if t.name in (HOST, DISK)})

    def make_room(self, owner: Tenant, key: ChunkKey, nbytes: int) -> None:
        """Before ``owner`` stores ``nbytes`` under ``key`` (an executor thread)."""
        self.usage.assign(key.namespace, owner.label)
        for tier, quota in ((HOST, owner.host_bytes), (DISK, owner.disk_bytes if self._disk else 0)):
            if not quota:
                continue
            # a re-put replaces the chunk's blob there: it adds only what it is larger by (before,
            # a re-put was never checked, and a tiny blob re-put large took any number of bytes)
            cost = self.usage.footprint(tier, nbytes)
            growth = cost - self.usage.held(tier, key.id)
            if growth <= 0:
                continue
            if cost > quota:
                raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"a chunk of {nbytes} bytes takes {cost} bytes of {tier}, more than this tenant's "
                           f"{tier} quota ({tier}_bytes = {quota})")
            over = self.usage.used(owner.label, tier) + growth - quota
            if over > 0:
                self._evict(owner, tier, over, key)

    def bounded(self, owner: Tenant) -> bool:
        """Whether ``owner`` has a quota here (else there is nothing to enforce)."""
        return bool(owner.host_bytes or (owner.disk_bytes and self._disk))

    def enforce(self, owner: Tenant) -> None:
        """After reads or prefetches that may have promoted ``owner``'s chunks into host RAM (an
        executor thread): its oldest chunks leave until it is within its quotas again."""
        for tier, quota in ((HOST, owner.host_bytes), (DISK, owner.disk_bytes if self._disk else 0)):
            if quota and (over := self.usage.used(owner.label, tier) - quota) > 0:
                self._evict(owner, tier, over, None)

    def _evict(self, owner: Tenant, tier: str, nbytes: int, keep: ChunkKey | None) -> None:
        victims = self.usage.oldest(owner.label, tier, nbytes, skip=frozenset({keep.id} if keep else ()))
        if tier == HOST and self._disk:
            on_disk = [k for k in victims if self.usage.holds(DISK, k.id)]
            self.store.drop(on_disk, HOST)
            victims = [k for k in victims if not self.usage.holds(DISK, k.id)]
        self.store.delete(victims)

    def charge(self, key: ChunkKey, owner: Tenant) -> None:
        """Count ``key``'s namespace for ``owner`` (its first put or read there): before, a
        namespace was counted only from its owner's first put, and chunks read back from disk
        after a restart, before any put, were charged to nobody."""
        self.usage.assign(key.namespace, owner.label)

    def used(self, owner: Tenant) -> dict[str, int]:
        return {tier: self.usage.used(owner.label, tier) for tier in (HOST, DISK)}
