"""A shared tier whose capacity is the cluster's budget for it, kept in the ledger
(kvstore/ledger.py), not this daemon's view of the medium.

Every write reserves its bytes in the ledger first and commits them once the value is in
place; every delete gives them back after the value is gone. So the values on the medium
never take more than the budget, whichever daemons wrote them. Making room is the ledger's
choice too (``make_room``): the victims may be any member's chunks, never a chunk a live
member pins, and this daemon deletes them before their bytes count as free.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Sequence

from kvstore.blob import HEADER_BYTES, CorruptBlob, decode_header
from kvstore.ledger import Ledger
from tiers.base import Buffer, Tier, TierError, TierFull
from tiers.wrapped import WrappedTier

log = logging.getLogger(__name__)


class BudgetedTier(WrappedTier):
    def __init__(self, inner: Tier, ledger: Ledger, member: str, budget_bytes: int, member_ttl_s: float,
                 busy_wait_s: float, forget: Callable[[str, Sequence[bytes]], None]) -> None:
        """``forget(tier name, key ids)`` tells the lookup index that values are gone."""
        super().__init__(inner)
        self.budgeted = True
        self.capacity_bytes = budget_bytes
        self.ledger, self.member = ledger, member
        self._ttl_s, self._busy_wait_s = member_ttl_s, busy_wait_s
        self._forget = forget
        self._used = 0  # the cluster's use of the budget, as the ledger last said
        self._owed: set[bytes] = set()  # reservations of failed writes still to release
        self._owed_lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        return self._used

    def make_room(self, need: int) -> None:
        """Until ``need`` bytes of the budget are free, delete the victims the ledger names;
        TierFull when everything left is pinned or being written. Where the ledger's last
        answer left room, nothing is asked: the reservation checks again, and a writer it
        refuses comes back here with the count it was refused on."""
        if self._used + need <= self.capacity_bytes:
            return
        while True:
            answer, self._used, victims = self.ledger.make_room(self.member, self.name, need, self._ttl_s)
            if answer == "ok":
                return
            if answer == "full":
                raise TierFull(f"{self.name}: cannot make room for {need} bytes of the cluster's budget "
                               f"({self._used}/{self.capacity_bytes} used; the rest is pinned or being written)")
            self.remove(victims)

    def remove(self, key_ids: Sequence[bytes]) -> None:
        """Delete values the ledger marked as this member's to delete, then free their bytes.
        A value that cannot be deleted (the medium is down) stays counted, and marked."""
        gone = []
        for key_id in key_ids:
            try:
                self.inner.delete(key_id)
                gone.append(key_id)
            except TierError as exc:
                log.warning("%s: cannot delete %s for the cluster's budget: %s", self.name, key_id.hex(), exc)
        if gone:
            self._forget(self.name, gone)
            self._used = self.ledger.evicted(self.member, self.name, gone)

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        size = sum(memoryview(p).nbytes for p in parts)
        deadline = time.monotonic() + self._busy_wait_s
        while True:
            answer, self._used = self.ledger.reserve(self.member, self.name, key, self.footprint(size), size, self._ttl_s)
            if answer == "present":  # another daemon wrote this very value (keys name content)
                return
            if answer == "ok":
                break
            if answer == "full":
                raise TierFull(f"{self.name}: {size} bytes do not fit the cluster's budget "
                               f"({self._used}/{self.capacity_bytes} used)")
            if time.monotonic() > deadline:  # busy: another member writes or deletes it
                raise TierError(f"{self.name}: {key.hex()} stayed busy in another member for {self._busy_wait_s} s")
            time.sleep(0.01)
        try:
            self.inner.write(key, parts)
            committed = self.ledger.commit(self.member, self.name, key)
        except BaseException:
            self._undo(key, parts)
            raise
        if not committed:
            self._undo(key, parts)
            raise TierError(f"{self.name}: {key.hex()} was deleted while it was written")

    def write_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """One ``write`` each: every value reserves and commits its own bytes."""
        for key, parts in items:
            self.write(key, parts)

    def _undo(self, key: bytes, parts: Sequence[Buffer]) -> None:
        """Remove a value written without a commit, and its reservation (owed for later if
        the ledger cannot be reached: a live member's reservation is never reaped). A write
        that failed may not have landed: an older value still there is whole (another
        encoding of the chunk, maybe a durable put's), so it stays and is counted again;
        before, the undo deleted it."""
        older = self._older_value(key, parts)
        if older is None:
            try:
                self.inner.delete(key)
            except TierError as exc:
                log.warning("%s: cannot remove uncommitted %s: %s", self.name, key.hex(), exc)
        try:
            self._used = self.ledger.release(self.member, self.name, [key], own_only=True)
        except TierError:
            with self._owed_lock:
                self._owed.add(key)
            return
        if older is not None:
            self._recount(key, older)

    def _older_value(self, key: bytes, parts: Sequence[Buffer]) -> int | None:
        """The size of a whole value under ``key`` that is not the one ``parts`` wrote; None
        if there is none, or it is ours, or the medium cannot tell."""
        ours = b"".join(bytes(memoryview(p).cast("B")[:HEADER_BYTES]) for p in parts)[:HEADER_BYTES]
        try:
            head = self.inner.peek(key, HEADER_BYTES)
            if head is None or head == ours:
                return None
            return decode_header(head).blob_len
        except (TierError, CorruptBlob):
            return None

    def _recount(self, key: bytes, size: int) -> None:
        """Count an older value that stayed in place of a failed write; one the budget has no
        room for any more goes, as an eviction would take it."""
        try:
            answer, self._used = self.ledger.reserve(self.member, self.name, key, self.footprint(size), size,
                                                     self._ttl_s)
            if answer == "ok":
                self.ledger.commit(self.member, self.name, key)
            elif answer == "full":
                self.inner.delete(key)
                self._forget(self.name, [key])
        except TierError as exc:
            log.warning("%s: cannot count the older value of %s again: %s", self.name, key.hex(), exc)

    def settle(self) -> None:
        """Release the reservations ``_undo`` could not (the heartbeat calls this)."""
        with self._owed_lock:
            owed = list(self._owed)
        if owed:
            self._used = self.ledger.release(self.member, self.name, owed, own_only=True)
            with self._owed_lock:
                self._owed.difference_update(owed)

    def delete(self, key: bytes) -> bool:
        """The entry is marked first, as evictions mark theirs: between the DEL and the release a
        member's reservation was answered "present", and its durable put wrote nothing."""
        self._used = self.ledger.deleting(self.member, self.name, [key])
        removed = self.inner.delete(key)
        self.ledger.evicted(self.member, self.name, [key])
        self._used = self.ledger.release(self.member, self.name, [key])
        return removed
