"""Deleting tier values, outside the index lock, without ever deleting a newer copy.

Deletes decided under the index lock (evictions, corrupt or stale replicas, ``delete``)
run after it is released, each under its (tier, key) mutation lock (kvstore/store/index.py): a
write of the same key either finished before (and the index lists it, so the delete is
skipped) or starts after. Shared tiers also update the shared index here, in that same
order, so a stale removal can never erase a fresh entry (review #20). Until it runs, the
value is ``doomed``: the tier holds it though the index does not list it, which
``check_integrity`` must not take for an orphan.
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

from kvstore.blob import HEADER_BYTES, BlobHeader, CorruptBlob, decode_header, verify_blob
from kvstore.store.index import ChunkIndex, KeyLocks, Replica
from tiers.base import Tier, TierError

log = logging.getLogger(__name__)


def peek_header(tier: Tier, key_id: bytes) -> BlobHeader | None:
    """The header of the value the medium holds for the key now (asked, not the tier's view);
    None if there is none, or it cannot be read, or it is not a whole blob header."""
    try:
        head = tier.peek(key_id, HEADER_BYTES)
        return None if head is None else decode_header(head)
    except (CorruptBlob, TierError):
        return None


def verified_header(tier: Tier, key_id: bytes) -> BlobHeader | None:
    """``peek_header`` for a value read whole: its header only if the payload checks out too
    (bit rot, a torn write of the payload leave the header intact); None otherwise."""
    try:
        data = tier.read(key_id)
        return None if data is None else verify_blob(data)[0]
    except (CorruptBlob, TierError, ValueError):  # ValueError: a larger value took its place meanwhile
        return None


class TierIO:
    def __init__(self, index: ChunkIndex, locks: KeyLocks, shared_index=None) -> None:
        self.index = index
        self.locks = locks
        self.shared_index = shared_index
        self._doomed: Counter[tuple[str, bytes]] = Counter()
        # shared tiers' values removed while a discovery (kvstore/store/discovery.py) looked at the
        # tiers: (tier, key) -> removal serial, kept only while a discovery begun before runs
        self._serial = 0
        self._removed: dict[tuple[str, bytes], int] = {}
        self._discoveries: Counter[int] = Counter()
        self._background = ThreadPoolExecutor(1, thread_name_prefix="tier-delete")

    def doom(self, tier_name: str, key_id: bytes) -> None:
        """The index dropped a replica whose value the caller deletes once the index lock is
        released (index lock held)."""
        self._doomed[tier_name, key_id] += 1

    def is_doomed(self, tier_name: str, key_id: bytes) -> bool:
        """Whether a delete of the tier's value is decided and not done yet (index lock held)."""
        return (tier_name, key_id) in self._doomed

    def discovering(self) -> int:
        """A discovery begins: the mark ``removed_since`` compares with (index lock held)."""
        self._discoveries[self._serial] += 1
        return self._serial

    def removed_since(self, tier_name: str, key_id: bytes, mark: int) -> bool:
        """Whether the tier's value of the key was removed after ``mark`` (index lock held)."""
        return self._removed.get((tier_name, key_id), -1) > mark

    def discovered(self, mark: int) -> None:
        """A discovery ended (index lock held): removals no running one began before are forgotten."""
        self._discoveries[mark] -= 1
        if self._discoveries[mark] <= 0:
            del self._discoveries[mark]
        oldest = min(self._discoveries, default=None)
        if oldest is None:
            self._removed.clear()
        elif oldest > mark:
            self._removed = {slot: n for slot, n in self._removed.items() if n > oldest}

    def doomed(self) -> set[bytes]:
        """Keys with a value waiting for its delete (index lock held)."""
        return {key_id for _, key_id in self._doomed}

    def delete(self, tier: Tier, key_id: bytes) -> TierError | None:
        """Delete ``tier``'s value of ``key_id`` unless the index lists a replica there again;
        the tier's error if it still holds the value (``delete_held``)."""
        with self.locks.hold(tier.name, key_id):
            with self.index.lock:
                entry = self.index.get(key_id)
                if entry is not None and tier.name in entry.replicas:
                    self._spared(tier.name, key_id)
                    return None
            return self.delete_held(tier, key_id)

    def delete_later(self, tier: Tier, key_id: bytes) -> None:
        """``delete`` on a background thread, for a reader: the key lock may be held by a
        writer of that tier for as long as the tier hangs, and a hung tier must never hold
        up reads."""
        self._background.submit(self._delete_logged, tier, key_id)

    def _delete_logged(self, tier: Tier, key_id: bytes) -> None:
        try:
            self.delete(tier, key_id)
        except Exception:  # noqa: BLE001 - a background task has no caller to raise to
            log.exception("%s: background delete of %s failed", tier.name, key_id.hex())

    def corrupt(self, key_id: bytes, tier: Tier, replica: Replica | None, exc: Exception) -> bool:
        """Drop ``replica``, which failed verification (and count it); its value is deleted
        in the background, unless a newer one took its place meanwhile. False, dropping
        nothing, if the index lists another copy there by now (the bytes read were the one it
        replaced) or none (deleted: its deleter deletes the value). Reads and copies written
        behind both drop what they find corrupt here: a damaged copy is never used or spread."""
        with self.index.lock:
            self.index.count(tier.name, corruptions=1)
            entry = self.index.get(key_id)
            if entry is None or replica is None or entry.replicas.get(tier.name) is not replica:
                log.warning("%s: a corrupt read of %s, whose copy was replaced or deleted meanwhile: %s",
                            tier.name, key_id.hex(), exc)
                return False
            self.index.remove_replica(key_id, entry, tier.name)
            self.doom(tier.name, key_id)
        log.warning("%s: dropping corrupt blob %s: %s", tier.name, key_id.hex(), exc)
        self.delete_later(tier, key_id)
        return True

    def close(self) -> None:
        """Wait for the background deletes."""
        self._background.shutdown(wait=True)

    def delete_held(self, tier: Tier, key_id: bytes) -> TierError | None:
        """Delete the value; the caller holds its key lock. A tier that cannot be reached keeps
        it (counted and logged, not raised). A private tier that still holds the value after a
        failed delete (its medium refused the unlink) keeps it doomed (the tier holds it, the
        index does not: not an orphan), and its error is returned: it would come back at the
        next start, so ``Store.delete`` must not report it gone. So is a shared tier's that
        still holds it (a PFS mount that refused the unlink), which stays discoverable."""
        unlisted = None
        if tier.shared and self.shared_index is not None:
            # before the value goes, not after: a daemon may write the chunk again once it is
            # gone (a cluster member, as soon as the ledger drops the entry, inside
            # ``tier.delete``), and a removal after that would erase its fresh entry, its
            # durable put then found nowhere after a restart. Unreachable, it still raises
            # once the delete is done, as it did after it.
            try:
                self.shared_index.remove(tier.name, [key_id])
            except TierError as exc:
                unlisted = exc
        error = None
        try:
            tier.delete(key_id)
        except TierError as exc:
            error = exc
            log.warning("%s: delete of %s failed: %s", tier.name, key_id.hex(), exc)
        held = error is not None and self._still_holds(tier, key_id)
        kept = held and not tier.shared  # a shared tier's value stays discoverable: it is there
        with self.index.lock:
            if error is not None:
                self.index.count(tier.name, errors=1)
            if not kept:
                self._spared(tier.name, key_id)
            if tier.shared and self._discoveries:  # a lookup that saw the value must not list it now
                self._serial += 1
                self._removed[tier.name, key_id] = self._serial
        if unlisted is not None:
            raise unlisted
        return error if held else None

    @staticmethod
    def _still_holds(tier: Tier, key_id: bytes) -> bool:
        """Whether ``tier`` still holds the value after its delete failed; a shared tier that
        cannot be reached cannot say, and its error is only counted and logged, as before."""
        try:
            return tier.contains(key_id)
        except TierError:
            return False

    def _spared(self, tier_name: str, key_id: bytes) -> None:
        """The doomed value's delete ran, or was called off (index lock held)."""
        slot = (tier_name, key_id)
        if self._doomed[slot] <= 1:
            self._doomed.pop(slot, None)
        else:
            self._doomed[slot] -= 1

    def vanished(self, tier: Tier, key_id: bytes) -> None:
        """A shared tier no longer holds a value (another daemon deleted it): the shared index
        forgets it too, unless a newer copy took its place meanwhile."""
        if not (tier.shared and self.shared_index is not None):
            return
        with self.locks.hold(tier.name, key_id):
            with self.index.lock:
                entry = self.index.get(key_id)
                if entry is not None and tier.name in entry.replicas:
                    return
            self.shared_index.remove(tier.name, [key_id])

    def published(self, tier: Tier, key_id: bytes, size: int) -> None:
        """A value was written to ``tier`` (the caller holds its key lock): other daemons may
        find it now, before a durable put returns."""
        if tier.shared and self.shared_index is not None:
            self.shared_index.add(tier.name, [key_id], [size])
