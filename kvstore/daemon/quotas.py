"""Per-tenant quotas of host and disk bytes: each tenant's settings handed to the Store's
replica ledger, which the Store keeps every owner within (kvstore/store/owner_quota.py).

The ledger (kvstore/store/quota.py) knows each tenant's bytes per tier, as the tiers hold them
(host-RAM pages, disk blocks: not blob bytes, which let a tenant of tiny chunks hold far more
than its quota), once the daemon has told it which tenant owns a namespace (``charge``, on a
tenant's first put or read there: chunks read back from disk after a restart, before any put,
count too). A put that would take its owner (the caller, or the shared tenant) over a quota
first makes room among that owner's own chunks, oldest first; a promotion into host RAM (a
read or a prefetch of a chunk on disk) only moves the owner's chunks that are on disk out of
host RAM, and is skipped when that is not enough. So a tenant at its quota replaces its own
chunks and never pushes out anybody else's, and what it pins in host RAM is within its quota.
"""

from __future__ import annotations

from kvstore.daemon.identity import Tenant
from kvstore.keys import ChunkKey
from kvstore.store import Store
from kvstore.store.quota import ReplicaUsage

HOST, DISK = "host", "disk"  # the Store's tiers a tenant's host_bytes and disk_bytes bound


class Quotas:
    def __init__(self, store: Store, usage: ReplicaUsage, tenants: list[Tenant]) -> None:
        self.usage = usage
        usage.measure({t.name: t.footprint for t in store.tiers if t.name in (HOST, DISK)})
        for tenant in tenants:
            usage.set_quotas(tenant.label, {HOST: tenant.host_bytes, DISK: tenant.disk_bytes})

    def charge(self, key: ChunkKey, owner: Tenant) -> None:
        """Count ``key``'s namespace for ``owner`` (its first put or read there)."""
        self.usage.assign(key.namespace, owner.label)

    def used(self, owner: Tenant) -> dict[str, int]:
        return {tier: self.usage.used(owner.label, tier) for tier in (HOST, DISK)}
