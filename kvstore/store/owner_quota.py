"""Keeping each owner (a daemon's tenant) within its quotas: an owner's put or promotion
makes room among that owner's own chunks, never anybody else's.

Quotas and what each owner holds per tier are the replica ledger's (kvstore/store/quota.py:
pages and blocks as the tiers hold them, not blob bytes). Before a put, an owner that would
go over a tier's quota loses chunks there, those the tier's eviction policy would evict first
among the owner's oldest (``ChunkIndex.eviction_order``: a chunk it keeps reading stays):
from the first tier (host RAM) those held by another tier leave it alone and the others are
deleted, from a lower tier they are deleted; a chunk larger than the quota itself is refused
(``QuotaExceeded``). A promotion (a chunk read from below into the first tier, by a read or a
prefetch) only drops first-tier copies of the owner's chunks that another tier holds, and is
skipped when that does not make room: a read never deletes an owner's data, and what an owner pins in host RAM stays within
its quota. Limits: puts and promotions of one owner in flight at once may overshoot by their
sizes until they end, and a chunk whose copy waits on a stalled tier stays in the first tier
(the copy's source) until that tier moves again.
"""

from __future__ import annotations

from kvstore.store.index import ChunkIndex
from kvstore.store.quota import ReplicaUsage
from kvstore.store.removal import Removal
from tiers.base import TierFull


CANDIDATES = 8  # the owner's oldest chunks ranked by the policy, in multiples of the room needed
MIN_CANDIDATES = 64


class QuotaExceeded(TierFull):
    """A chunk takes more of a tier than its owner's whole quota there."""


class OwnerQuotas:
    def __init__(self, index: ChunkIndex, usage: ReplicaUsage, removal: Removal, first: str) -> None:
        self.index, self.usage, self.removal, self.first = index, usage, removal, first

    def make_room(self, key_id: bytes, nbytes: int) -> None:
        """Before a put of ``nbytes`` under ``key_id`` (no lock held): its owner's chunks
        that the tier's policy ranks lowest leave each tier where the put would take it over
        its quota. A re-put adds only what it is larger by."""
        owner, quotas = self.usage.quotas_of(key_id)
        for tier, quota in quotas.items():
            over = self._over(owner, tier, quota, key_id, nbytes)
            if over <= 0:
                continue
            ids = self._victims(owner, tier, over, key_id)
            if tier == self.first:
                elsewhere = {k for k in ids if self._held_below(k)}
                self.removal.drop([k for k in ids if k in elsewhere], tier)
                ids = [k for k in ids if k not in elsewhere]
            self.removal.delete(ids)

    def room_for_promotion(self, key_id: bytes, nbytes: int) -> bool:
        """Before a chunk read from below is copied into the first tier (no lock held):
        whether its owner has room there, made by dropping first-tier copies of its chunks
        that another tier holds (in the policy's order); False: promote nothing."""
        owner, quotas = self.usage.quotas_of(key_id)
        quota = quotas.get(self.first)
        if not quota:
            return True
        try:
            over = self._over(owner, self.first, quota, key_id, nbytes)
            if over <= 0:
                return True
            self.removal.drop(self._victims(owner, self.first, over, key_id, self._held_below), self.first)
            return self._over(owner, self.first, quota, key_id, nbytes) <= 0
        except QuotaExceeded:
            return False

    def _victims(self, owner: str, tier: str, nbytes: int, key_id: bytes, eligible=None) -> list[bytes]:
        """``owner``'s chunks in ``tier`` other than ``key_id`` (and only those ``eligible``
        says) that add up to ``nbytes`` (or all there are), those the tier's policy would
        evict first. They are ranked among the owner's oldest (``CANDIDATES`` times what is
        needed, at least ``MIN_CANDIDATES`` chunks), as Redis samples its LRU: a put at its
        quota costs about what it frees, not what the owner holds; among all of them when
        those are not enough."""
        for window in (CANDIDATES * nbytes, None):
            counted = dict(self.usage.oldest(owner, tier, window, at_least=MIN_CANDIDATES, skip=key_id))
            out, total = [], 0
            for k in self.index.eviction_order(tier, list(counted)):
                if total >= nbytes:
                    break
                if eligible is None or eligible(k):
                    out.append(k)
                    total += counted[k]
            if total >= nbytes:
                break
        return out

    def _over(self, owner: str, tier: str, quota: int, key_id: bytes, nbytes: int) -> int:
        """The bytes ``owner`` would hold in ``tier`` beyond ``quota`` once the chunk is there."""
        cost = self.usage.footprint(tier, nbytes)
        growth = cost - self.usage.held(tier, key_id)
        if growth <= 0:
            return 0
        if cost > quota:
            raise QuotaExceeded(f"a chunk of {nbytes} bytes takes {cost} bytes of {tier}, more than its owner's "
                                f"{tier} quota ({quota} bytes)")
        return self.usage.used(owner, tier) + growth - quota

    def _held_below(self, key_id: bytes) -> bool:
        """Whether a tier other than the first holds the chunk's current copy."""
        with self.index.lock:
            entry = self.index.get(key_id)
            return entry is not None and any(entry.current(t) is not None for t in entry.replicas if t != self.first)
