"""A shared tier whose capacity is the cluster's budget for it, kept in the ledger
(kvstore/cluster/ledger.py), not this daemon's view of the medium.

Every write reserves its bytes in the ledger first and commits them once the value is in
place; every delete gives them back after the value is gone. So the values on the medium
never take more than the budget, whichever daemons wrote them. Making room is the ledger's
choice too (``make_room``): the victims may be any member's chunks, never a chunk a live
member pins, and this daemon deletes them before their bytes count as free.

Every delete on the medium is fenced by the member's lease (kvstore/cluster/lease.py): one the
ledger granted before a break in the lease, or with the lease run out, fails as the medium
being unavailable, and the heartbeat settles it with the ledger again.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Sequence

from kvstore.blob import HEADER_BYTES, CorruptBlob, decode_header
from kvstore.cluster.lease import Lease
from kvstore.cluster.ledger import Ledger
from tiers.base import Buffer, Tier, TierError, TierFull
from tiers.wrapped import WrappedTier

log = logging.getLogger(__name__)


class BudgetedTier(WrappedTier):
    def __init__(self, inner: Tier, ledger: Ledger, member: str, budget_bytes: int, member_ttl_s: float,
                 busy_wait_s: float, forget: Callable[[str, Sequence[bytes]], None], lease: Lease) -> None:
        """``forget(tier name, key ids)`` tells the lookup index that values are gone; ``lease``
        fences every delete on the medium."""
        super().__init__(inner)
        self.budgeted = True
        self.capacity_bytes = budget_bytes
        self.ledger, self.member = ledger, member
        self._ttl_s, self._busy_wait_s = member_ttl_s, busy_wait_s
        self._forget = forget
        self._lease = lease
        self._used = 0  # the cluster's use of the budget, as the ledger last said
        # Work a failure left half-done, finished by ``settle`` (the heartbeat), under one lock:
        # reservations to release: key -> an older value to count again (None: the one the medium holds then)
        self._owed: dict[bytes, bytes | None] = {}
        self._undos: dict[bytes, tuple[bytes, str]] = {}  # undos still to do: key -> (our header, token)
        self._uncommitted: dict[bytes, bytes] = {}  # commits whose reply was lost: key -> our header
        self._undeleted: set[bytes] = set()  # values marked evicting whose delete failed
        self._lost_rooms: set[str] = set()  # tokens of make_room calls whose reply was lost
        self._recounts: dict[bytes, bytes] = {}  # older values still to count again: key -> their header
        self._pending_lock = threading.Lock()
        # A key is written or settled, never both at once: a settle's undo of an old write
        # would delete a newer write's value of the same blob (``_settle_keys``).
        self._writing: dict[bytes, int] = {}  # key -> writes in flight
        self._settling: set[bytes] = set()
        self._key_free = threading.Condition(self._pending_lock)

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
            token, term = secrets.token_hex(12), self._lease.term
            self._lease.check(term, f"{self.name}: make room")  # else its victims would only pile up undeleted
            try:
                answer, self._used, victims = self.ledger.make_room(self.member, self.name, need, self._ttl_s, token)
            except TierError:  # it may have run: its victims are this member's to delete (``settle``)
                with self._pending_lock:
                    self._lost_rooms.add(token)
                raise
            if answer == "ok":
                return
            if answer == "full":
                raise TierFull(f"{self.name}: cannot make room for {need} bytes of the cluster's budget "
                               f"({self._used}/{self.capacity_bytes} used; the rest is pinned or being written)")
            self.remove(victims, term)

    def remove(self, key_ids: Sequence[bytes], term: int) -> None:
        """Delete values the ledger marked as this member's to delete, then free their bytes.
        A value that cannot be deleted (the medium is down) stays counted, and marked, until
        ``settle`` deletes it; so do the values deleted when the ledger, or the lookup index,
        cannot be told (their entries stay evicting: nobody could write those chunks again;
        forgotten by this member, they stayed so for as long as it lived). ``term`` is the
        lease's term read before the ledger named them (``Lease.check``)."""
        gone = []
        for key_id in key_ids:
            try:
                self._lease.check(term, f"{self.name}: delete {key_id.hex()}")
                self.inner.delete(key_id)
                gone.append(key_id)
            except TierError as exc:
                log.warning("%s: cannot delete %s for the cluster's budget: %s", self.name, key_id.hex(), exc)
                with self._pending_lock:
                    self._undeleted.add(key_id)
        if gone:
            try:
                self._forget(self.name, gone)
            except TierError:
                with self._pending_lock:
                    self._undeleted.update(gone)
                raise
            self._used = self._evicted(gone)

    def _evicted(self, key_ids: Sequence[bytes]) -> int:
        """Tell the ledger these values are gone. If it cannot be told, their entries stay
        marked evicting by this member, and ``settle`` tells it again."""
        try:
            return self.ledger.evicted(self.member, self.name, key_ids)
        except TierError:
            with self._pending_lock:
                self._undeleted.update(key_ids)
            raise

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        with self._pending_lock:
            while key in self._settling:  # a settle of an older write of the key ends first
                self._key_free.wait()
            lost = self._uncommitted.pop(key, None)  # this write's own commit decides now, not a settle
            self._writing[key] = self._writing.get(key, 0) + 1
        try:
            self._write(key, parts, lost)
        finally:
            with self._pending_lock:
                left = self._writing.pop(key) - 1
                if left:
                    self._writing[key] = left

    def _write(self, key: bytes, parts: Sequence[Buffer], lost: bytes | None) -> None:
        """``lost``: the header of an earlier write of the key whose commit failed (``_commit``)."""
        size = sum(memoryview(p).nbytes for p in parts)
        ours = self._header(parts)
        deadline = time.monotonic() + self._busy_wait_s
        take = False
        while True:
            try:
                answer, self._used = self.ledger.reserve(self.member, self.name, key, self.footprint(size), size,
                                                         self._ttl_s, take)
            except TierError:  # it may have run, its reply lost: the entry this member's, pending (``settle``)
                with self._pending_lock:
                    self._owed.setdefault(key, None)
                raise
            if answer == "present":  # a resident value of this size: this very blob if its header is ours...
                if self.inner.peek(key, HEADER_BYTES) == ours:
                    return
                # ...else gone from the medium (Redis evicting on its own), or another put's blob of the
                # chunk (same codec, other bytes): take the entry and write ours, as a blob of another
                # size would replace it (kept, this put was acknowledged without its copy on the tier)
                take = True
                continue
            if answer == "ok":
                break
            if answer == "full":
                self._refused(key, lost)
                raise TierFull(f"{self.name}: {size} bytes do not fit the cluster's budget "
                               f"({self._used}/{self.capacity_bytes} used)")
            if time.monotonic() > deadline:  # busy: another member writes or deletes it
                self._refused(key, lost)
                raise TierError(f"{self.name}: {key.hex()} stayed busy in another member for {self._busy_wait_s} s")
            time.sleep(0.01)
        try:
            self.inner.write(key, parts)
        except BaseException:
            self._undo(key, ours)
            raise
        try:
            committed = self._commit(key, ours)
        except TierError:
            raise
        except BaseException:
            self._undo(key, ours)
            raise
        if not committed:
            self._undo(key, ours)
            raise TierError(f"{self.name}: {key.hex()} was deleted while it was written")

    def _refused(self, key: bytes, lost: bytes | None) -> None:
        """A write the ledger refused took no entry over: an earlier write's failed commit is
        ``settle``'s again. Forgotten, that write's entry stayed this member's, pending (a
        reserve answers "full" without touching it): the key busy to every other member, its
        bytes counted and never evictable, for as long as this member lived."""
        if lost is not None:
            with self._pending_lock:
                self._uncommitted.setdefault(key, lost)

    def write_many(self, items: Sequence[tuple[bytes, Sequence[Buffer]]]) -> None:
        """One ``write`` each: every value reserves and commits its own bytes."""
        for key, parts in items:
            self.write(key, parts)

    @staticmethod
    def _header(parts: Sequence[Buffer]) -> bytes:
        return b"".join(bytes(memoryview(p).cast("B")[:HEADER_BYTES]) for p in parts)[:HEADER_BYTES]

    def _undo(self, key: bytes, ours: bytes, token: str | None = None) -> None:
        """Remove a value written without a commit, and its bytes, only while this member holds
        the key's entry (``Ledger.undoing``: none left, or its own reservation): asking who held
        it and deleting in a second step let another member reserve, write and commit the key
        in between, and deleted that member's acknowledged value. Under another member's entry
        the value is that member's (keys name content) and stays; under one being deleted, or
        when the ledger cannot be asked, the undo waits for the next heartbeat. An older value
        still there (the write did not land: another encoding, maybe a durable put's) stays
        and is counted again."""
        token, term = token or secrets.token_hex(12), self._lease.term
        older = self._older_value(key, ours)
        if older is not None:
            try:
                self._used = self.ledger.release(self.member, self.name, [key], own_only=True)
            except TierError:
                with self._pending_lock:  # ``settle`` releases it, then counts the older value
                    self._owed[key] = older
                return
            self._recount(key, older, term)
            return
        try:
            answer = self.ledger.undoing(self.member, self.name, key, token)
        except TierError as exc:
            answer = "busy"
            log.warning("%s: cannot undo the uncommitted write of %s now: %s", self.name, key.hex(), exc)
        if answer == "busy":
            with self._pending_lock:
                self._undos[key] = (ours, token)
            return
        if answer != "mine":
            return
        try:  # the entry is this member's, evicting: no other member writes the key meanwhile
            self._lease.check(term, f"{self.name}: undo {key.hex()}")
            self.inner.delete(key)
        except TierError as exc:
            log.warning("%s: cannot remove uncommitted %s: %s", self.name, key.hex(), exc)
            with self._pending_lock:  # the entry stays taken: ``settle`` deletes it
                self._undeleted.add(key)
            return
        try:
            self._used = self._evicted([key])
        except TierError:
            pass  # ``settle`` tells the ledger again

    def _older_value(self, key: bytes, ours: bytes) -> bytes | None:
        """The header of a whole value under ``key`` that is not ``ours`` (the one this write
        wrote); None if there is none, or it is ours, or the medium cannot tell."""
        try:
            head = self._value_header(key)
        except TierError:
            return None
        return None if head == ours else head

    def _value_header(self, key: bytes) -> bytes | None:
        """The header of the whole value under ``key``, None if there is none; TierError when
        the medium cannot tell."""
        head = self.inner.peek(key, HEADER_BYTES)
        if head is None:
            return None
        try:
            decode_header(head)
        except CorruptBlob:
            return None
        return head

    def _recount(self, key: bytes, older: bytes, term: int) -> None:
        """Count an older value (its header ``older``) that stayed in place of a failed write;
        one the budget has no room for any more goes, as an eviction would take it (while the
        lease holds). Its reservation released, this member holds no entry of the key: the
        value is deleted only once ``Ledger.undoing`` gave it one, since a delete without it
        removed the value another member reserved, wrote and committed meanwhile (a durable
        put, acknowledged, still counted). Under another member's entry ('kept') or one being
        deleted ('busy': its holder removes the value) it stays. A failed commit is committed
        again by ``settle``, as a write's is (``_commit``): left pending, the key was busy to
        every other member and its bytes never evictable for as long as this member lived. A
        failed reserve is done again by ``settle``: it may not have run (the value counted by
        nobody, evictable by nobody: the budget exceeded for good) or its reply was lost (the
        entry this member's, pending, as after a failed commit)."""
        size = decode_header(older).blob_len
        answer = None
        try:
            answer, self._used = self.ledger.reserve(self.member, self.name, key, self.footprint(size), size,
                                                     self._ttl_s)
            if answer == "ok":
                self._commit(key, older)
            elif answer == "full":
                self._drop_older(key, term)
        except TierError as exc:
            log.warning("%s: cannot count the older value of %s again: %s", self.name, key.hex(), exc)
            if answer is None:  # the reserve failed (a failed commit or delete is noted already)
                with self._pending_lock:
                    self._recounts[key] = older

    def _drop_older(self, key: bytes, term: int) -> None:
        try:
            taken = self.ledger.undoing(self.member, self.name, key, secrets.token_hex(12))
        except TierError:
            with self._pending_lock:  # it may have run: ``settle`` deletes the value if the entry is this member's
                self._undeleted.add(key)
            raise
        if taken == "mine":
            self.remove([key], term)  # a failure is left to ``settle``

    def settle(self) -> None:
        """Finish what a failure left half-done (the heartbeat calls this; a TierError leaves
        the rest for the next beat): commit again the writes whose commit reply was lost; undo
        the writes whose undo had to wait; delete the victims of make_room calls whose reply
        was lost, and the values whose delete the medium refused (while their entries stay
        evicting, nobody may write those keys, and their bytes stay counted); release the
        reservations of failed reserves (their reply may be lost) and those ``_undo`` could
        not release, then count again the older values under them, and those ``_undo`` could
        not count."""
        self._settle_keys(self._uncommitted, self._settle_commit)
        self._settle_keys(self._undos, lambda key, owed: self._undo(key, *owed))
        self._settle_deletes()
        self._settle_keys(self._owed, self._settle_release)
        self._settle_keys(self._recounts, self._settle_recount)

    def _settle_keys(self, pending: dict, settle_one: Callable) -> None:
        """Each key is settled while no write of it is in flight, and writes of it wait until
        its settle ends: a write between a settle's commit and its undo re-took the entry and
        wrote the same blob, which the undo then deleted. A key being written is left for the
        next beat (a write pops its key's lost commit: its own commit decides)."""
        with self._pending_lock:
            keys = list(pending)
        for key in keys:
            with self._pending_lock:
                if key in self._writing or key not in pending:
                    continue
                owed = pending.pop(key)
                self._settling.add(key)
            try:
                settle_one(key, owed)
            finally:
                with self._pending_lock:
                    self._settling.discard(key)
                    self._key_free.notify_all()

    def _commit(self, key: bytes, ours: bytes) -> bool:
        """The ledger's commit of this member's write of ``key``. A failed call may have run
        and only its reply was lost: then the value is resident, counted, and a member may
        have been told "present" since. Never deleted on a guess: the heartbeat asks again
        (``settle``)."""
        try:
            return self.ledger.commit(self.member, self.name, key)
        except TierError:
            with self._pending_lock:
                self._uncommitted[key] = ours
            raise

    def _settle_commit(self, key: bytes, ours: bytes) -> None:
        if not self._commit(key, ours):  # the entry was taken from this member meanwhile
            self._undo(key, ours)

    def _settle_release(self, key: bytes, older: bytes | None) -> None:
        """Release this member's own pending entry of ``key``, then count the older value again.
        A write's lost reserve (None) may have replaced the entry of the value the medium holds
        (one of another size, or a take): that value is counted again, looked at before the
        release, while the entry, if the reserve ran, keeps other members from writing the key.
        Ordered against writes of the key (``_settle_keys``): a write of it in flight took that
        entry over, and a release now made its commit answer 0 and the write fail for nothing."""
        try:
            if older is None:
                older = self._value_header(key)
            self._used = self.ledger.release(self.member, self.name, [key], own_only=True)
        except TierError:
            with self._pending_lock:
                self._owed[key] = older
            raise
        if older is not None:
            self._settle_recount(key, older)

    def _settle_recount(self, key: bytes, older: bytes) -> None:
        """Only while the older value is still what the medium holds: a write since replaced
        it and counted its own (one of this member's took over the pending entry a lost reply
        left), so a write does not drop the recount (one refused before it wrote leaves the
        older value). Gone (Redis dropped it), only that entry, if the reserve ran, is left
        to release."""
        term = self._lease.term
        try:
            there = self.inner.peek(key, HEADER_BYTES)
            if there is None:
                self._used = self.ledger.release(self.member, self.name, [key], own_only=True)
        except TierError:
            with self._pending_lock:
                self._recounts[key] = older
            raise
        if there == older:
            self._recount(key, older, term)

    def _settle_deletes(self) -> None:
        with self._pending_lock:
            rooms = list(self._lost_rooms)
        for token in rooms:
            victims = self.ledger.room_victims(token)
            with self._pending_lock:
                self._lost_rooms.discard(token)
                self._undeleted.update(victims)
        with self._pending_lock:
            undeleted = list(self._undeleted)
            self._undeleted.difference_update(undeleted)
        if undeleted:
            term = self._lease.term
            try:  # only those still marked evicting by this member: an entry it never marked is not its to delete
                mine = self.ledger.mine_to_delete(self.member, self.name, undeleted)
            except TierError:
                with self._pending_lock:
                    self._undeleted.update(undeleted)
                raise
            self.remove(mine, term)  # failures are noted again

    def delete(self, key: bytes) -> bool:
        """The key's entry is taken first (``Ledger.deleting``), as evictions take theirs, so that
        no member's reservation of it is granted, or answered "present", while the value goes;
        ``evicted`` then drops that entry and nothing else. (A release after it dropped whatever
        entry the key had by then: a reservation another member was granted in between, even
        committed, its durable put acknowledged with its value uncounted.)"""
        term = self._lease.term
        self._used = self.ledger.deleting(self.member, self.name, [key])
        try:
            self._lease.check(term, f"{self.name}: delete {key.hex()}")
            removed = self.inner.delete(key)
        except TierError:
            with self._pending_lock:  # the entry stays taken (evicting): ``settle`` tries again
                self._undeleted.add(key)
            raise
        self._used = self._evicted([key])
        return removed
