"""The chunk index: every chunk the Store knows, its replicas, pins and policy membership,
under one lock that is never held across tier I/O.

A chunk's life (one ``Entry``; each tier holds at most one ``Replica`` of it)::

                 put of a new blob                         put of the same blob again
    (absent) ─────────────────────► version v ◄──────────────────────── a hit, no write
                                     │ first tier: RESIDENT v (not evictable while its
                                     │   copies are queued: they read from it)
                                     │ each replica tier: QUEUED v ─ copy ─► RESIDENT v
                                     │                              └ fails ─► absent there
                                     │ put of another blob (another codec): version v+1;
                                     │   the replicas of v become STALE: never read, kept
                                     │   until v+1's copy replaces them or they are evicted
                                     │   (a restart before that serves them again: a whole
                                     │   older encoding, never a gap)
    RESIDENT in a tier ── evict / drop / corrupt / vanished ──► absent from that tier
                       ── placement ──► RECODING ──► RESIDENT, smaller encoding, same version
    any state ── delete ──► absent: queued copies cancelled, files removed before it returns
    no replica left and no copy queued ──► absent (with only stale ones: absent to lookups)

Who may change what:
- Entries, replicas, pins, policies and counters change only under ``ChunkIndex.lock``, and
  only by ``ChunkIndex`` methods (one per transition above): other modules read them.
- One tier's value for one key changes (write, delete, re-encode) only under that (tier,
  key)'s mutation lock (``KeyLocks``), and the index learns of the change before the lock
  is released, so a deferred delete can check that no newer copy took the value's place.
- Lock order: a key lock, then the index lock, never the reverse; a thread holds at most
  one key lock. No deadlock is possible, and a hung tier only slows calls on its own keys.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

from kvstore.blob import BlobHeader
from kvstore.codecs import codec_by_id
from kvstore.policies.base import EvictionPolicy
from kvstore.store.quota import NO_USAGE, ReplicaUsage
from kvstore.wire.stats import EWMA_ALPHA, TierStats

STALE = -1  # the version of a recovered copy holding another blob than the first one found


class StoreClosed(RuntimeError):
    pass


@dataclass
class Replica:
    """One tier's copy of a chunk: its size there, its encoding and its blob's payload
    checksum (both None until a read or the recovery scan has seen its header) and the put
    version it holds. The checksum names the very blob this store wrote or verified there
    (a re-encoding's own, not the put's): on a shared tier a peer's put of the chunk may
    replace it with another blob of the same codec and size."""

    size: int
    codec_id: int | None
    version: int
    synced: bool = False  # written with sync(): a power loss keeps it (durable puts need this)
    # listed on a shared tier (at start, or a peer's), not written here: whether it is synced is
    # not known, and it may hold a durable put's bytes, so a copy that replaces it is synced
    found: bool = False
    checksum: int | None = None

    @classmethod
    def of(cls, header: BlobHeader, size: int, version: int, **flags) -> "Replica":
        """The replica of a blob whose header is known: its encoding and payload checksum."""
        return cls(size, header.codec_id, version, checksum=header.payload_checksum, **flags)

    def is_blob(self, header: BlobHeader | None) -> bool:
        """Whether ``header`` (None: no whole blob) names the very blob this replica records."""
        return header is not None and (header.codec_id, header.payload_checksum) == (self.codec_id, self.checksum)


@dataclass
class Entry:
    version: int  # the latest put's version: replicas of older ones are stale
    size: int  # the latest put's blob size (what write-behind copies)
    header: BlobHeader | None  # the latest put's header, once known
    replicas: dict[str, Replica] = field(default_factory=dict)
    parent: bytes | None = None  # the previous chunk's key id, for policies that use prefix structure
    # the namespace's model, once a put named it: the codec verdicts that hold for the chunk (None: lossless only)
    model_id: str | None = None
    pinned_until: float = 0.0
    heap_until: float = 0.0  # expiry of this key's one entry in the pin heap; 0 when it has none
    copying: int = 0  # copies of the latest version queued or in flight (they read the first tier)
    recoding: set[str] = field(default_factory=set)  # tiers re-encoding their copy now

    def current(self, tier_name: str) -> Replica | None:
        """The tier's replica if it holds the latest version (readable), else None."""
        replica = self.replicas.get(tier_name)
        return replica if replica is not None and replica.version == self.version else None

    def known_current(self, tier_name: str) -> Replica | None:
        """``current(tier_name)`` if its blob is known to be the latest put's. A copy found on
        a shared tier by a lookup (its header never read) is readable, but may hold another
        blob of the chunk (another daemon's encoding, or an older put): a put still copies there."""
        replica = self.current(tier_name)
        return replica if replica is not None and replica.codec_id is not None else None

    def readable(self) -> bool:
        return any(r.version == self.version for r in self.replicas.values())


@dataclass(frozen=True)
class IndexSnapshot:
    """What ``Store.stats()`` reports of the index, taken at one instant under its lock."""

    tiers: dict[str, TierStats]  # copies of the per-tier counters
    chunks: int  # readable chunks
    puts: int
    hits: int
    misses: int
    pinned: int


class KeyLocks:
    """One mutex per (tier, key) in use, made on demand and dropped when nobody holds it."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._locks: dict[tuple[str, bytes], list] = {}  # -> [lock, users]

    @contextmanager
    def hold(self, tier_name: str, key_id: bytes) -> Iterator[None]:
        slot = (tier_name, key_id)
        with self._mutex:
            held = self._locks.get(slot)
            if held is None:
                held = self._locks[slot] = [threading.Lock(), 0]
            held[1] += 1
        try:
            with held[0]:
                yield
        finally:
            with self._mutex:
                held[1] -= 1
                if held[1] == 0:
                    del self._locks[slot]

    def held(self) -> list[tuple[str, bytes]]:
        """The (tier, key) locks held or waited for now."""
        with self._mutex:
            return list(self._locks)


class ChunkIndex:
    """Entries by key id, each tier's policy, the pins, and the counters stats() reports.

    ``first`` is the name of the tier every put lands in. ``changed`` is notified whenever
    room may have appeared (copies done, pins expired, entries gone)."""

    def __init__(self, policies: dict[str, EvictionPolicy], capacities: dict[str, int], first: str,
                 footprints: dict, usage: ReplicaUsage | None = None) -> None:
        self.lock = threading.RLock()
        self.usage = usage or NO_USAGE  # told of every replica recorded and removed (kvstore/store/quota.py)
        self.changed = threading.Condition(self.lock)
        self.entries: dict[bytes, Entry] = {}
        self.policies = policies
        self.first = first
        self._footprint = footprints  # tier name -> footprint(size) of that tier
        self.stats = {name: TierStats(name, cap) for name, cap in capacities.items()}
        self.puts = self.hits = self.misses = 0
        self.closed = False
        self._pins: list[tuple[float, bytes]] = []  # (expiry, key id), at most one per key
        self._version = 0

    def next_version(self) -> int:
        self._version += 1
        return self._version

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosed("store is closed")

    def close(self) -> None:
        """Refuse calls from now on, and wake whoever waits for room or copies."""
        self.closed = True
        self.changed.notify_all()

    def get(self, key_id: bytes) -> Entry | None:
        return self.entries.get(key_id)

    # -- policy membership ----------------------------------------------------------------

    def evictable(self, tier_name: str, entry: Entry, now: float | None = None) -> bool:
        if tier_name not in entry.replicas or tier_name in entry.recoding:
            return False
        if entry.pinned_until > (time.monotonic() if now is None else now):
            return False
        return not (tier_name == self.first and entry.copying)

    def sync(self, key_id: bytes, entry: Entry) -> None:
        """Make each tier's policy track the key exactly when it is evictable there. A held
        chunk leaves with ``on_remove`` and comes back with ``on_insert``, which policies
        treat as a hand-back, not an access (kvstore/policies/base.py). An entry that is no
        longer the key's (deleted, maybe put again since) changes nothing: the policies
        track the key for its current entry, and a late sync of the old one, by work that
        outlived it, would take the key out of every policy."""
        if self.entries.get(key_id) is not entry:
            return
        for name, policy in self.policies.items():
            want = self.evictable(name, entry)
            if want and key_id not in policy:
                policy.on_insert(key_id, self._footprint[name](entry.replicas[name].size), entry.parent)
            elif not want and key_id in policy:
                policy.on_remove(key_id, held=name in entry.replicas)
            elif name not in entry.replicas:  # gone from the tier, maybe while held: no hand-back is coming
                policy.on_remove(key_id, held=False)

    def hit(self, key_id: bytes, entry: Entry) -> None:
        """An access: every tier holding a replica hears of it, held replicas too (the policy
        keeps the hit for their hand-back)."""
        for name, policy in self.policies.items():
            if name in entry.replicas:
                policy.on_hit(key_id)

    def eviction_order(self, tier_name: str, key_ids: list[bytes]) -> list[bytes]:
        """``key_ids`` in the order the tier's policy would evict them (``victim_rank``); keys
        it does not track (held: pinned, being copied or re-encoded) last, in the order given."""
        with self.lock:
            policy = self.policies.get(tier_name)
            ranks = [None] * len(key_ids) if policy is None else [policy.victim_rank(k) for k in key_ids]
        tracked = sorted((i for i, r in enumerate(ranks) if r is not None), key=ranks.__getitem__)
        return [key_ids[i] for i in tracked] + [k for k, r in zip(key_ids, ranks) if r is None]

    # -- replicas -------------------------------------------------------------------------

    def set_replica(self, key_id: bytes, entry: Entry, tier_name: str, replica: Replica) -> None:
        if tier_name in self.policies and key_id in self.policies[tier_name] and tier_name in entry.replicas:
            # a new size: the policy must learn it (out, then back in as a hand-back)
            self.policies[tier_name].on_remove(key_id, held=True)
        self.record(key_id, entry, tier_name, replica)
        self.sync(key_id, entry)

    def record(self, key_id: bytes, entry: Entry, tier_name: str, replica: Replica) -> None:
        """Put ``replica`` in the entry as its tier's copy (policies are the caller's)."""
        entry.replicas[tier_name] = replica
        self.usage.added(tier_name, key_id, replica.size)

    def remove_replica(self, key_id: bytes, entry: Entry, tier_name: str) -> None:
        """The index forgets one tier's copy (the caller deletes the value)."""
        if entry.replicas.pop(tier_name, None) is not None:
            self.usage.removed(tier_name, key_id)
        self.sync(key_id, entry)
        self.forget_if_empty(key_id, entry)

    def forget_if_empty(self, key_id: bytes, entry: Entry) -> None:
        """Drop the entry once no replica and no queued copy is left. An entry whose replicas
        are all stale stays (unreadable, so absent to lookups): those are whole older
        encodings, which a restart serves again if the newer one never reached that tier,
        so a re-put that was not durable never loses an older durable one. They are
        evictable like any replica."""
        if entry.replicas or entry.copying or self.entries.get(key_id) is not entry:
            return
        del self.entries[key_id]
        entry.pinned_until = 0.0
        self.changed.notify_all()

    def pop(self, key_id: bytes) -> list[str] | None:
        """Remove an entry outright (delete); returns the tiers whose values the caller must
        delete, or None if the key was absent."""
        entry = self.entries.get(key_id)
        if entry is None:
            return None
        tiers = list(entry.replicas)
        for name in tiers:
            self.usage.removed(name, key_id)
        entry.replicas.clear()
        entry.pinned_until = 0.0
        self.sync(key_id, entry)  # while it is still the key's entry, so the policies let go
        del self.entries[key_id]
        self.changed.notify_all()
        return tiers

    # -- pins ---------------------------------------------------------------------------------

    def pin(self, key_id: bytes, entry: Entry, until: float) -> None:
        if until > entry.pinned_until:
            entry.pinned_until = until
        if entry.heap_until == 0.0 or entry.pinned_until < entry.heap_until:
            # no item, or one that comes due later than this pin ends (an unpin came between):
            # a new item, and the old one is skipped when it comes due
            entry.heap_until = entry.pinned_until
            heapq.heappush(self._pins, (entry.heap_until, key_id))
            if len(self._pins) > 2 * len(self.entries) + 64:
                self._rebuild_pins()
        self.sync(key_id, entry)

    def _rebuild_pins(self) -> None:
        """Drop the heap's stale items (deleted entries, superseded items): one per pinned key."""
        self._pins = [(e.heap_until, k) for k, e in self.entries.items() if e.heap_until]
        heapq.heapify(self._pins)

    def unpin(self, key_id: bytes, entry: Entry) -> bool:
        if entry.pinned_until <= time.monotonic():
            return False
        entry.pinned_until = 0.0
        self.sync(key_id, entry)
        self.changed.notify_all()
        return True

    def expire_pins(self, now: float | None = None) -> None:
        """Hand back chunks whose pins ran out. Each pinned key has one heap entry: when it
        comes due while the pin was extended, it is pushed again at the new expiry."""
        now = time.monotonic() if now is None else now
        expired = False
        while self._pins and self._pins[0][0] <= now:
            until, key_id = heapq.heappop(self._pins)
            entry = self.entries.get(key_id)
            if entry is None or entry.heap_until != until:
                continue  # deleted, or an item of an entry since replaced
            if entry.pinned_until > now:
                entry.heap_until = entry.pinned_until
                heapq.heappush(self._pins, (entry.heap_until, key_id))
                continue
            entry.heap_until = 0.0
            self.sync(key_id, entry)
            expired = True
        if expired:
            self.changed.notify_all()

    @property
    def pin_heap_size(self) -> int:
        return len(self._pins)

    def pinned_count(self, now: float) -> int:
        """Pins alive at ``now``: the same instant the caller expired the heap at, so a
        snapshot never counts no pins while the heap still holds one that ran out between
        two clock readings."""
        return sum(1 for e in self.entries.values() if e.pinned_until > now)

    # -- puts -----------------------------------------------------------------------------------

    def learn_model(self, entry: Entry, model_id: str | None) -> None:
        """A chunk put by id alone learns its model once a put names it."""
        if model_id is not None:
            entry.model_id = model_id

    def put_hit(self, key_id: bytes, entry: Entry) -> None:
        """A put of the blob the first tier holds: an access, nothing written."""
        self.puts += 1
        self.hit(key_id, entry)

    def commit_put(self, key_id: bytes, header: BlobHeader, size: int, parent: bytes | None,
                   model_id: str | None) -> Entry:
        """A put's blob is in the first tier: the entry (new, or a new version when the blob
        differs from the latest put's) lists it there. Returns the key's entry."""
        self.puts += 1
        entry = self.entries.get(key_id)
        if entry is None:
            entry = self.entries[key_id] = Entry(self.next_version(), size, header, parent=parent, model_id=model_id)
        else:
            self.hit(key_id, entry)
            if entry.header != header:  # another blob of the chunk: a new version
                entry.version, entry.size, entry.header = self.next_version(), size, header
            entry.parent = parent if parent is not None else entry.parent
            self.learn_model(entry, model_id)
        self.set_replica(key_id, entry, self.first, Replica.of(header, size, entry.version))
        self.stats[self.first].bytes_written += size
        return entry

    def promoted(self, key_id: bytes, entry: Entry, header: BlobHeader, size: int, version: int) -> None:
        """A read's bytes of ``version`` were copied into the first tier."""
        self.set_replica(key_id, entry, self.first, Replica.of(header, size, version))
        self.stats[self.first].bytes_written += size

    # -- copies written behind ---------------------------------------------------------------

    def copy_queued(self, key_id: bytes, entry: Entry) -> None:
        """A copy of the latest version is queued: the first tier's copy, its source, stays."""
        entry.copying += 1

    def copy_done(self, key_id: bytes, entry: Entry, tier_name: str | None = None,
                  replica: Replica | None = None) -> None:
        """A queued copy ended: written (``replica`` in ``tier_name``), failed, dropped or
        cancelled. The first tier's copy may be evicted once no other copy reads it."""
        entry.copying -= 1
        if replica is not None and self.entries.get(key_id) is entry:
            self.set_replica(key_id, entry, tier_name, replica)
        self.sync(key_id, entry)
        self.forget_if_empty(key_id, entry)
        self.changed.notify_all()

    def mark_synced(self, entry: Entry, tier_name: str, replica: Replica) -> None:
        """``replica``, still the tier's copy, was synced: a power loss keeps it."""
        if entry.replicas.get(tier_name) is replica:
            replica.synced = True

    # -- placement's re-encoding in place ----------------------------------------------------

    def recode_started(self, key_id: bytes, entry: Entry, tier_name: str) -> None:
        """The tier's copy is being re-encoded: out of its policy, not evicted meanwhile."""
        entry.recoding.add(tier_name)
        self.sync(key_id, entry)

    def recode_done(self, entry: Entry, tier_name: str) -> None:
        """The re-encoding ended (swapped in or not): the copy is evictable again once the
        caller settled it (reinstated at its new size, or removed) and synced the policies."""
        entry.recoding.discard(tier_name)

    def recoded(self, key_id: bytes, entry: Entry, tier_name: str, replica: Replica, footprint: int) -> None:
        """The re-encoded copy took the planned one's place (``recode_done`` first): the
        policy keeps the key at its new ``footprint``, not as a new access."""
        self.record(key_id, entry, tier_name, replica)
        self.stats[tier_name].recodes += 1
        self.stats[tier_name].bytes_written += replica.size
        if self.evictable(tier_name, entry):
            self.policies[tier_name].reinstate(key_id, footprint, entry.parent)
        self.sync(key_id, entry)

    # -- reads -----------------------------------------------------------------------------

    def read_hit(self, key_id: bytes, tier_name: str, replica: Replica, header: BlobHeader, elapsed: float) -> bool:
        """A verified read of ``replica``: counted, and the header learnt where the replica's
        was not known (later reads of raw bytes go direct; a peer's blob that replaces it is
        told apart). Returns whether the chunk should be promoted into the first tier."""
        self.hits += 1
        stats = self.stats[tier_name]
        stats.lossy_hits += not codec_by_id(header.codec_id).lossless
        stats.hits += 1
        stats.bytes_read += replica.size
        gbps = replica.size / max(elapsed, 1e-9) / 1e9
        stats.read_gbps = gbps if stats.read_gbps == 0 else (1 - EWMA_ALPHA) * stats.read_gbps + EWMA_ALPHA * gbps
        entry = self.entries.get(key_id)
        if entry is None:
            return False
        if entry.replicas.get(tier_name) is replica:
            replica.codec_id = header.codec_id
            replica.checksum = header.payload_checksum
            if entry.header is None and replica.version == entry.version and replica.size == entry.size:
                entry.header = header
        self.hit(key_id, entry)
        return tier_name != self.first and entry.current(self.first) is None and entry.current(tier_name) is replica

    def read_miss(self, key_id: bytes) -> None:
        """No replica delivered the chunk: counted, and every policy hears of it."""
        self.misses += 1
        for name, policy in self.policies.items():
            policy.on_miss(key_id)
            self.stats[name].misses += 1

    # -- chunks found on the tiers ---------------------------------------------------------------

    def recovered(self, key_id: bytes, tier_name: str, size: int, header: BlobHeader | None, found: bool) -> Replica:
        """A tier's value found at start becomes a replica (kvstore/store/recovery.py): current
        if it is the first found of its chunk or holds the same blob as that one, else STALE."""
        entry = self.entries.get(key_id)
        current = entry is None or (header is not None and header == entry.header)
        if entry is None:
            entry = self.entries[key_id] = Entry(version=0, size=size, header=header)
        replica = Replica(size, header.codec_id if header is not None else None, 0 if current else STALE,
                          found=found, checksum=header.payload_checksum if header is not None else None)
        self.record(key_id, entry, tier_name, replica)
        self.sync(key_id, entry)
        return replica

    def discovered(self, key_id: bytes, where: dict[str, int]) -> None:
        """Shared tiers' values of a chunk found by a lookup (kvstore/store/discovery.py), by
        tier name and size; their codec is learnt on their first read. A chunk new to the
        index gets a version of its own: one deleted and found again is another entry, which
        a promotion of a read of the first one (it checks the version) must not take for it."""
        entry = self.entries.get(key_id)
        if entry is None:
            entry = self.entries[key_id] = Entry(self.next_version(), next(iter(where.values())), None)
        for name, size in where.items():
            if name not in entry.replicas:
                self.set_replica(key_id, entry, name, Replica(size, None, entry.version, found=True))

    # -- stats -------------------------------------------------------------------------------

    def count(self, tier_name: str, **increments: int) -> None:
        """Add to a tier's counters (``TierStats`` fields: errors, evictions, corruptions...)."""
        stats = self.stats[tier_name]
        for field_name, n in increments.items():
            setattr(stats, field_name, getattr(stats, field_name) + n)

    def snapshot(self) -> IndexSnapshot:
        """The counters and counts ``stats()`` reports, at one instant (pins expired first)."""
        now = time.monotonic()
        self.expire_pins(now)
        return IndexSnapshot({name: dataclasses.replace(s) for name, s in self.stats.items()},
                             sum(1 for e in self.entries.values() if e.readable()),
                             self.puts, self.hits, self.misses, self.pinned_count(now))
