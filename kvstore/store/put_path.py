"""The put protocol: a chunk's blob into the first tier, then its copies queued behind.

One put, top to bottom (``put_blob``):

1. **Look** (index lock): a plain put of the very blob the first tier holds is an access and
   writes nothing; otherwise the replica tiers still needing a copy are listed.
2. **Reserve** room for those copies in the write-behind queues (it may wait: backpressure).
3. **Write first**: room is made in the first tier (eviction, which may wait for copies in
   flight to free the chunks they hold), then the blob is written under its key lock.
4. **Commit** (index lock, still under the key lock): the index records the first tier's
   copy (``ChunkIndex.commit_put``), and the copies are queued with the reserved room.
5. A durable put then waits on its ticket until its own copies are written and synced.

A blob travels as a ``SealedBlob`` (its header parsed once, by whoever received it), an
``UnsealedBlob`` (its header known once the first tier has checksummed the payload) or a
``ClaimedBlob`` (its header verified, its payload checked as the first tier copies it in): no
step decodes it again. Promotion of a chunk read below the first tier is the same write, made
only if the chunk did not change meanwhile and the first tier has room without waiting.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from kvstore.blob import BlobHeader, ClaimedBlob, SealedBlob, UnsealedBlob
from kvstore.codecs import Codec
from kvstore.config import StoreConfig
from kvstore.keys import ChunkKey
from kvstore.store.deletes import TierIO
from kvstore.store.eviction import Evictor
from kvstore.store.index import ChunkIndex, Entry, KeyLocks
from kvstore.store.owner_quota import OwnerQuotas
from kvstore.store.placement import Placement, planned_read_bytes_per_s
from kvstore.store.replication import TierOption, plan as replication_plan
from kvstore.store.ticket import Ticket
from kvstore.store.write_behind import Reservation, WriteBehind
from tiers.base import FirstTier, Tier, TierError, TierFull

Blob = SealedBlob | UnsealedBlob | ClaimedBlob


class PutPath:
    def __init__(self, config: StoreConfig, index: ChunkIndex, locks: KeyLocks, io: TierIO, first: FirstTier,
                 replica_tiers: Sequence[Tier], evictor: Evictor, write_behind: WriteBehind,
                 placement: Placement | None, quotas: OwnerQuotas) -> None:
        self.config = config
        self.index, self.locks, self.io, self.first = index, locks, io, first
        self.replica_tiers = list(replica_tiers)
        self.evictor, self.write_behind, self.placement = evictor, write_behind, placement
        self.quotas = quotas  # each owner's puts and promotions stay within its quotas

    def put(self, key: ChunkKey, kv: torch.Tensor, parent: ChunkKey | None, durable: bool, chosen: Codec) -> None:
        """Encode a tensor with ``chosen`` and put it (``Store.put``)."""
        key.namespace.check(kv)
        kv = kv.detach().to("cpu").contiguous()
        payload = chosen.encode(kv)
        with self.index.lock:
            fresh = self.index.get(key.id) is None
        if fresh:  # the first tier checksums the payload as it copies it in (one pass)
            blob: Blob = UnsealedBlob(key, chosen.codec_id, kv.dtype, kv.shape, payload, self.config.blob_version)
        else:  # a re-put is recognised by its header, checksum included: pack it first
            blob = SealedBlob.pack(key, chosen.codec_id, kv.dtype, kv.shape, payload, self.config.blob_version)
        self.put_blob(key.id, blob, parent.id if parent else None, durable, key.namespace.model_id)

    def put_blob(self, key_id: bytes, blob: Blob, parent: bytes | None, durable: bool, model_id: str | None) -> None:
        """Store a blob (``Store.put_blob``); an ``UnsealedBlob`` is a new one (its header is
        known once written: put meanwhile by another caller, the chunk gets a new version)."""
        header = blob.header
        ticket = Ticket() if durable else None
        self.quotas.make_room(key_id, blob.size)
        while not self._put_once(key_id, blob, header, parent, ticket, model_id):
            pass  # the chunk changed while its copies' room was reserved: look again
        if ticket is not None:
            ticket.wait(self.config.write_behind.durable_timeout_s)

    def _put_once(self, key_id: bytes, blob: Blob, header: BlobHeader | None, parent: bytes | None,
                  ticket: Ticket | None, model_id: str | None) -> bool:
        first = self.first.name
        with self.index.lock:
            self.index.check_open()
            entry = self.index.get(key_id)
            if entry is not None:
                self.index.learn_model(entry, model_id)
            same = entry is not None and header is not None and entry.header == header
            host = entry.current(first) if same else None
            present = host is not None and host.size == blob.size
            if present and ticket is None:  # an access; its copies on shared tiers are looked at behind
                self.index.put_hit(key_id, entry)
                self._recheck(key_id, entry, blob.size)
                return True
            needs = [t.name for t in self.replica_tiers
                     if not (same and WriteBehind.done_there(t, entry.known_current(t.name), ticket is not None))]
        reservation = self.write_behind.reserve(blob.size, needs)
        if present:  # a durable put of what is there: its copies must be written and synced
            with self.index.lock:
                if self.index.get(key_id) is not entry or entry.current(first) is not host:
                    self.write_behind.release(reservation)
                    return False
                self.index.put_hit(key_id, entry)
                self.write_behind.queue(key_id, entry, reservation, ticket)
            return True
        try:
            self._write_first(key_id, blob, True, None,
                              lambda: self._commit(key_id, blob, parent, reservation, ticket, model_id))
        except BaseException:
            self.write_behind.release(reservation)
            raise
        return True

    def _recheck(self, key_id: bytes, entry: Entry, size: int) -> None:
        """Queue a look at the chunk's copy on each shared tier where the index lists one (a
        peer may have replaced it), where the queue has room now (index lock held): a plain put
        of what is there is an access and does not wait for write-behind."""
        rechecks = self.write_behind.rechecks(entry)
        if rechecks:
            room = self.write_behind.try_reserve(size, rechecks)
            if room.tiers:
                self.write_behind.queue(key_id, entry, room, None, list(room.tiers))

    def _commit(self, key_id: bytes, blob: Blob, parent: bytes | None, reservation: Reservation,
                ticket: Ticket | None, model_id: str | None) -> bool:
        """The index learns of a put's first-tier copy and its copies are queued (index lock held)."""
        entry = self.index.commit_put(key_id, blob.header, blob.size, parent, model_id)
        # a durable put is a promise about every replica tier; a plain one gets the planned copies,
        # and looks at those on shared tiers where a peer may have replaced its blob
        only = None if ticket else self._planned_copies(key_id, entry)
        if only is not None:
            only += self.write_behind.rechecks(entry)
        self.write_behind.queue(key_id, entry, reservation, ticket, only)
        return True

    def _planned_copies(self, key_id: bytes, entry: Entry) -> list[str] | None:
        """The replica tiers that should get a copy of ``entry`` besides those that have one
        (index lock held): None for every one (``replication.mode = "all"``), else the
        replication planner's choice (kvstore/store/replication.py)."""
        if self.config.replication.mode == "all" or entry.header is None:
            return None
        stats, placement = self.index.stats, self.config.placement

        def bandwidth(name: str) -> float:
            return planned_read_bytes_per_s(placement, name, stats[name].read_gbps)

        have = {t.name: bandwidth(t.name) for t in self.replica_tiers if entry.current(t.name) is not None}
        options = [TierOption(t.name, bandwidth(t.name), t.footprint(entry.size),
                              t.capacity_bytes - t.used_bytes >= t.footprint(entry.size), self.evictor.displaced[t.name])
                   for t in self.replica_tiers if t.name not in have]
        reuse = self.index.policies[self.first.name].reuse_estimate(key_id)
        return replication_plan(reuse, entry.size, entry.header.shape[2] / placement.prefill_tokens_per_s, have, options)

    def _write_first(self, key_id: bytes, blob: Blob, wait: bool, precheck: Callable[[], bool] | None,
                     commit: Callable[[], bool]) -> bool:
        """Write a blob into the first tier under its key lock, making room first (without the
        lock: eviction takes other keys' locks); with ``wait``, for as long as copies in flight
        hold the room. ``precheck()`` (index lock held, before the write) may call it off;
        ``commit()`` (index lock held, right after it) says whether the value stays, else it
        is deleted before the key lock is released."""
        tier = self.first
        if self.placement is not None:  # measured in the background; eviction waits for it, not the write
            self.placement.profile_soon(blob.dtype, blob.shape)
        while True:
            self.evictor.make_room(tier, tier.footprint(blob.size), exclude=key_id,
                                   copies=self.write_behind if wait else None)
            with self.locks.hold(tier.name, key_id):
                with self.index.lock:
                    self.index.check_open()
                    if precheck is not None and not precheck():
                        return False
                try:
                    blob.write_to(tier, key_id)
                except TierFull:
                    if not wait:
                        return False
                    continue  # another writer took the room meanwhile: make room again
                with self.index.lock:
                    keep = commit()
                if not keep:
                    self.io.delete_held(tier, key_id)
                return keep

    def promote(self, key_id: bytes, version: int, parts: list, size: int, header: BlobHeader) -> None:
        """Copy a chunk read from a lower tier into the first tier, unless it changed meanwhile
        (replaced, deleted: a deleted chunk never comes back, review #17) or the first tier
        has no room that is not pinned or waiting for copies."""
        if not self.config.promote_on_read:
            return
        first = self.first.name

        def unchanged() -> bool:
            entry = self.index.get(key_id)
            return entry is not None and entry.version == version and entry.current(first) is None

        def commit() -> bool:
            if not unchanged():
                return False
            entry = self.index.get(key_id)
            self.index.promoted(key_id, entry, header, size, version)
            more = self._planned_copies(key_id, entry)
            if more:  # read again from below: it may have earned more copies (never waited for)
                room = self.write_behind.try_reserve(entry.size, more)
                self.write_behind.queue(key_id, entry, room, None, list(room.tiers))
            return True

        with self.index.lock:
            if not unchanged():
                return
        if not self.quotas.room_for_promotion(key_id, size):
            return  # its owner is at its quota with nothing that could leave host RAM: served from below
        try:
            self._write_first(key_id, SealedBlob(parts, header), False, unchanged, commit)
        except TierError:
            pass  # the first tier is full of pinned or queued chunks: served without promoting
