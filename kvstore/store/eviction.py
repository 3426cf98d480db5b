"""Making room in a tier: eviction by the tier's policy, and placement's re-encoding of
victims worth keeping smaller (kvstore/store/placement.py, docs/placement.md).

Victims are chosen under the index lock and leave the index at once; their values are
deleted after it is released (kvstore/store/deletes.py), so a slow medium never holds the lock.
A victim placement keeps is re-encoded outside every lock and swapped in under its key
lock, if nothing changed meanwhile.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from kvstore.blob import CorruptBlob, decode_header, reencoded_header, verify_blob
from kvstore.codecs import Codec, codec_by_id
from kvstore.store.index import ChunkIndex, Entry, KeyLocks, Replica
from kvstore.store.placement import Placement
from kvstore.store.replication import DisplacedReuse
from kvstore.store.deletes import TierIO
from tiers.base import Tier, TierError, TierFull

log = logging.getLogger(__name__)


class CopiesInFlight(Protocol):
    """Copies written behind, whose chunks the first tier holds until they are done
    (kvstore/store/write_behind.py); each call with the index lock held."""

    def shed_stalled(self) -> bool:
        """Drop the copies waiting for stalled tiers; whether any was dropped."""

    def progressing(self) -> bool:
        """Whether copies are queued on a tier that is not stalled."""

    def hurry(self) -> AbstractContextManager[None]:
        """While inside, copies are taken without their delay (they hold the room needed)."""


@dataclass
class _Recode:
    """A victim placement re-encodes in place: out of its tier's policy meanwhile."""

    tier: Tier
    key_id: bytes
    entry: Entry
    replica: Replica  # the copy as planned; the swap happens only if it is still there
    codec: Codec


class Evictor:
    def __init__(self, index: ChunkIndex, locks: KeyLocks, io: TierIO, tiers: dict[str, Tier],
                 placement: Placement | None, placement_tiers: set[str], track_displaced: bool = False) -> None:
        self.index, self.locks, self.io, self.tiers = index, locks, io, tiers
        self.placement = placement
        self.placement_tiers = placement_tiers if placement is not None else set()
        # what a new copy in each tier would displace: kept only for replication's planner
        self.displaced = DisplacedReuse() if track_displaced else None
        self.recode_failures = 0

    def make_room(self, tier: Tier, need: int, exclude: bytes | None = None, copies: CopiesInFlight | None = None,
                  recode: bool = True) -> None:
        """Evict from ``tier`` until ``need`` more bytes fit; call without any lock held.
        With ``copies`` (a put's room in the first tier), where only chunks whose copies are
        not done are left there: the copies still waiting for a stalled tier
        (``write_behind.stall_s`` without progress) are dropped and their chunks evicted, and
        otherwise the put waits for the copies while their tiers make progress: this is
        write-behind's backpressure.
        Raises TierFull when the rest is pinned or in use, or being copied to a stalled tier.
        A budgeted tier (a cluster's shared tier) makes room itself, by its ledger's choice."""
        if tier.budgeted:
            tier.make_room(need)
            return
        if recode and tier.capacity_bytes - tier.used_bytes < need:  # victims to plan: with the profiles
            self.wait_profiles()
        while True:
            with self.index.lock:
                deletes, job = self._choose(tier, need, exclude, copies, recode)
            for name, key_id in deletes:
                self.io.delete(self.tiers[name], key_id)
            if job is not None:
                self._recode(job)
            elif not deletes:
                return

    def _choose(self, tier: Tier, need: int, exclude: bytes | None, copies: CopiesInFlight | None, recode: bool):
        """Victims until ``need`` bytes would be free, as (tier, key) deletes to run, or the
        first victim placement keeps (lock held)."""
        index = self.index
        index.expire_pins()
        policy = index.policies[tier.name]
        deletes: list[tuple[str, bytes]] = []
        freed = 0
        passed_over: list[bytes] = []
        try:
            while tier.capacity_bytes - tier.used_bytes + freed < need:
                try:
                    victim = policy.evict()
                except LookupError:
                    if deletes:
                        break  # free what was chosen, then look again
                    held = copies is not None and tier.name == index.first
                    if held and copies.shed_stalled():
                        continue  # their chunks are evictable now
                    if held and copies.progressing():
                        with copies.hurry():  # what is evictable waits for its copies
                            index.changed.wait(timeout=1.0)
                        index.expire_pins()
                        continue
                    raise TierFull(f"{tier.name}: cannot make room for {need} bytes (the rest is pinned, in use, "
                                   f"or being copied to a stalled tier)") from None
                if victim == exclude:
                    passed_over.append(victim)
                    continue
                entry = index.get(victim)
                replica = entry.replicas.get(tier.name) if entry is not None else None
                if replica is None:
                    self.io.doom(tier.name, victim)
                    deletes.append((tier.name, victim))  # a policy key the index lost: free it anyway
                    continue
                job = self._plan_recode(tier, victim, entry, replica) if recode else None
                if job is not None:
                    index.recode_started(victim, entry, tier.name)
                    return deletes, job
                index.count(tier.name, evictions=1)
                if self.displaced is not None:
                    self.displaced.evicted(tier.name, policy.reuse_estimate(victim))
                freed += tier.footprint(replica.size)
                index.remove_replica(victim, entry, tier.name)
                self.io.doom(tier.name, victim)
                deletes.append((tier.name, victim))
            return deletes, None
        finally:
            for key_id in passed_over:  # back in the policy: the caller is rewriting it
                entry = index.get(key_id)
                if entry is not None:
                    index.sync(key_id, entry)

    # -- placement: re-encoding victims in place ------------------------------------------------

    def _read_bytes_per_s(self, tier_name: str) -> float:
        return self.placement.read_bytes_per_s(tier_name, self.index.stats[tier_name].read_gbps)

    def wait_profiles(self) -> None:
        """Wait (without any lock held) for codec profiles still being measured in the
        background (kvstore/store/placement.py): what to re-encode, and into what, is decided
        with them."""
        if self.placement is not None:
            self.placement.wait_profiles()

    def write_codec(self, tier: Tier, entry: Entry, source: Replica) -> Codec | None:
        """The encoding placement wants for the copy of ``entry`` written behind to ``tier``,
        or None for the put's own (index lock held): only raw chunks of known shape, and
        only for a placement tier other than the first."""
        header = entry.header
        if (self.placement is None or not self.placement.config.encode_on_write or tier.name not in self.placement_tiers
                or tier.name == self.index.first or header is None or source.codec_id != 0
                or source.version != entry.version or not self.placement.profiled(header.dtype, header.shape)):
            return None
        room = tier.capacity_bytes - tier.used_bytes >= tier.footprint(source.size)
        choice = self.placement.choose_on_write(entry.model_id, header.dtype, header.shape, source.size,
                                                self._read_bytes_per_s(tier.name), tier.footprint, room)
        return None if choice is None else choice.codec

    def _plan_recode(self, tier: Tier, key_id: bytes, entry: Entry, replica: Replica) -> _Recode | None:
        """The re-encoding placement wants for a victim just evicted from ``tier``, or None to
        drop it (lock held). Only current copies whose chunk header is known are planned."""
        header = entry.header
        if tier.name not in self.placement_tiers or header is None or replica.version != entry.version:
            return None
        if replica.codec_id is None or not self.placement.profiled(header.dtype, header.shape):
            return None
        if tier.name == self.index.first and entry.copying:
            return None
        reuse = self.index.policies[tier.name].reuse_estimate(key_id)
        if reuse <= 0:
            return None
        fallback_s = self.placement.recompute_s(header.shape)
        for name, other in entry.replicas.items():
            if name != tier.name and other.version == entry.version and other.codec_id is not None:
                fallback_s = min(fallback_s, self.placement.load_s(
                    header.dtype, header.shape, other.size, other.codec_id, self._read_bytes_per_s(name)))
        choice = self.placement.choose(entry.model_id, header.dtype, header.shape, replica.size, reuse, fallback_s,
                                       self._read_bytes_per_s(tier.name), tier.footprint)
        return None if choice is None else _Recode(tier, key_id, entry, replica, choice.codec)

    def _recode(self, job: _Recode) -> None:
        """Read, verify, decode and re-encode a victim outside every lock, then swap it in
        under its key lock."""
        parts = None
        try:
            blob = job.tier.read(job.key_id)
            if blob is not None and len(blob) == job.replica.size:
                header, payload = verify_blob(blob)
                tensor = codec_by_id(header.codec_id).decode(payload, header.shape, header.dtype)
                encoded = job.codec.encode(tensor)
                parts = [reencoded_header(header, job.codec.codec_id, encoded), encoded]
        except (CorruptBlob, TierError, OSError, ValueError, KeyError) as exc:
            log.warning("%s: re-encoding %s as %s failed: %s", job.tier.name, job.key_id.hex(), job.codec.name, exc)
        with self.locks.hold(job.tier.name, job.key_id):
            self._swap(job, parts)

    def _planned(self, job: _Recode) -> bool:
        """Whether the planned copy is still the chunk's copy in its tier (index lock held).
        While the key lock is held nobody else writes it; only the index can have moved on
        (deleted, dropped, found corrupt), and whoever did that deletes the value after us."""
        return self.index.get(job.key_id) is job.entry and job.entry.replicas.get(job.tier.name) is job.replica

    def _swap(self, job: _Recode, parts: list | None) -> None:
        """Put the re-encoded copy in place of the planned one, or evict that one as usual if
        re-encoding failed or did not shrink it (key lock held)."""
        tier, key_id, entry, name, index = job.tier, job.key_id, job.entry, job.tier.name, self.index
        size = sum(len(p) for p in parts) if parts is not None else 0
        keep = parts is not None and tier.footprint(size) < tier.footprint(job.replica.size)
        with index.lock:
            keep = keep and self._planned(job)
            synced = job.replica.synced
        written = keep and self._replace(tier, key_id, parts, synced)
        with index.lock:
            index.recode_done(entry, name)
            if not self._planned(job):
                index.sync(key_id, entry)
                return
            if written:
                index.recoded(key_id, entry, name, Replica.of(decode_header(parts[0]), size, job.replica.version,
                                                              synced=synced), tier.footprint(size))
                return
            self.recode_failures += 1
            index.count(name, evictions=1)
            index.remove_replica(key_id, entry, name)
        self.io.delete_held(tier, key_id)

    @staticmethod
    def _replace(tier: Tier, key_id: bytes, parts: list, sync: bool) -> bool:
        """Replace a value atomically, synced if the old one was (a durable put's copy stays
        one); where the tier has no room for both copies at once, delete the old one first
        (the victim is out for that moment, as if evicted). False if the tier ends up without
        the new copy, or without it synced where it must be."""
        try:
            tier.write(key_id, parts)
        except TierFull:
            try:
                tier.delete(key_id)
                tier.write(key_id, parts)
            except TierError:
                return False
        except TierError:
            return False
        try:
            if sync:
                tier.sync(key_id)
        except (TierError, OSError):
            return False
        return True
