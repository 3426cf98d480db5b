"""Write-behind: copies of new chunks to the replica tiers, one queue and pool of workers per tier.

A put of a new blob queues one copy job per replica tier; a worker writes it from the first
tier's copy, pinned while it reads. A re-put queues one too on each shared tier where the
index lists the chunk's copy: a peer may have replaced it, so the job looks at the medium
first (the header; for a durable put, the whole blob) and writes unless it holds that very
blob. Per tier:

- At most one job per key waits: a re-put before it starts updates it in place, so the
  newest version is copied, once; a re-put while it runs queues a job behind it, and jobs
  of one key never run at once (they write under the key's mutation lock anyway).
- Backpressure bounds the first tier's pages that cannot be evicted yet, not the queue's
  length: a job's chunk is held in the first tier until its copy is done, so the first
  tier's own room bounds every queue, and a put waits only when that room would fill with
  such chunks (the evictor waits for copies then, kvstore/store/eviction.py). A fixed fraction
  made a burst that fit in host RAM wait for the disk once the fraction was queued (issue
  #37). ``max_pending_bytes`` (default: the first tier's capacity) caps a queue below that
  where a user sets it: a put waits for room in it while the tier makes progress.
- A copy waits ``delay_s`` after its put before a worker takes it, so that a burst of puts
  has the memory bandwidth and the cores to itself (a copy written beside it halved the
  burst's speed and tripled its P99, issue #37), and a chunk deleted or replaced meanwhile
  is never written. Nothing waits on the delay: a durable put's copy, a flush, a drop, an
  eviction that needs a chunk's first-tier pages (``hurry``) and closing take copies at once.
- A tier is stalled when it has copies in flight and has finished none for ``stall_s``
  since it took them on (a hung mount, a Redis that stopped answering). The clock runs only
  while the tier holds work: queue room a put holds while it waits elsewhere, or copies
  waiting for a worker that the machine's load keeps off a core, are not the tier's delay,
  and a busy tier that finishes copies is never stalled (taking those for a stall skipped
  a working disk's copies, test_13 in tests/store/test_store_races.py). Puts skip a stalled tier
  (counted in ``dropped``); the copies already waiting for it stay queued until a put needs
  the first-tier room their chunks hold, and only then are dropped (``shed_stalled``,
  counted and logged): a hung tier slows only its own copies, never other tiers', puts or
  reads (review #13).
- A durable put waits on a ``Ticket`` of its own, done when a copy of its version (or a
  later one) is written and synced on every replica tier, or failed with that tier's error.
  Nobody else's put can clear it (review #3), and a copy that cannot be made (the first
  tier's copy is gone, the tier is stalled) fails it instead of passing silently (#2).

With placement, a copy may be written in another encoding than the put's (``write_codec``,
kvstore/store/eviction.py): the worker verifies and decodes the pinned first-tier copy and encodes
it before writing; if the codec refuses the chunk, it writes the put's encoding. A first-tier
copy that fails verification is neither copied nor kept: ``TierIO.corrupt`` drops it (the read path's
rule), and the copy fails.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from collections import OrderedDict
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from kvstore.blob import CorruptBlob, decode_header, reencoded_header, verify_blob
from kvstore.codecs import Codec, codec_by_id
from kvstore.config import WriteBehindConfig
from kvstore.store.deletes import TierIO, peek_header, verified_header
from kvstore.store.eviction import Evictor
from kvstore.store.index import ChunkIndex, Entry, KeyLocks, Replica
from kvstore.store.ticket import Ticket
from tiers.base import FirstTier, Tier, TierError, TierFull, TierUnavailable

log = logging.getLogger(__name__)


@dataclass
class CopyJob:
    key_id: bytes
    entry: Entry
    size: int  # bytes counted against the queue's room
    due: float  # time.monotonic() from which a worker takes it without being hurried
    tickets: list[Ticket] = field(default_factory=list)


def lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by ``nice`` (Linux keeps one per thread): a copy
    written behind then takes a core only when puts and reads leave one idle. Threads this
    one starts inherit it, so the pools that serve callers are started before (the Store
    starts kernels/parallel_copy.py's)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # a sandbox that forbids it: the copies run at the caller's priority
        log.warning("write-behind: could not lower the copy threads' priority: %s", exc)


@dataclass
class Reservation:
    """Queue room reserved for a put's copies, by tier; ``stalled`` tiers got none."""

    size: int
    tiers: list[str]
    stalled: list[str]


@dataclass
class _Queue:
    tier: Tier
    waiting: OrderedDict = field(default_factory=OrderedDict)  # key id -> CopyJob
    running: dict = field(default_factory=dict)  # key id -> CopyJob
    pending_bytes: int = 0  # waiting + running jobs + reservations
    last_progress: float = 0.0  # the last copy finished, or the first taken on since none ran


class WriteBehind:
    def __init__(self, index: ChunkIndex, locks: KeyLocks, io: TierIO, first: FirstTier, tiers: Sequence[Tier],
                 evictor: Evictor, config: WriteBehindConfig, max_pending_bytes: int) -> None:
        """``evictor`` makes room in the replica tiers and chooses a copy's encoding;
        ``max_pending_bytes`` is ``config.max_pending_bytes`` resolved (kvstore/store/facade.py)."""
        self.index, self.locks, self.io, self.first = index, locks, io, first
        self._evictor = evictor
        self.queues = {t.name: _Queue(t) for t in tiers}
        self.max_pending_bytes = max_pending_bytes
        self.stall_s = config.stall_s
        self.delay_s = config.delay_s
        self._hurry = 0  # callers waiting for copies: workers take them without their delay
        self._nice = config.nice
        self._closing = False
        self.dropped = 0
        self._threads = [
            threading.Thread(target=self._work, args=(q,), name=f"copy-{name}-{i}", daemon=True)
            for name, q in self.queues.items() for i in range(max(1, config.workers))
        ]
        for t in self._threads:
            t.start()

    # -- backpressure ---------------------------------------------------------------------

    def _stalled(self, q: _Queue, now: float) -> bool:
        """Copies are in flight on ``q``'s tier and none finished for ``stall_s`` since it
        took them on (index lock held)."""
        return bool(q.running) and now - q.last_progress > self.stall_s

    def reserve(self, size: int, tier_names: Sequence[str]) -> Reservation:
        """Room for ``size`` bytes in each named queue; waits while a queue is full and its
        tier makes progress (call without the index lock)."""
        reserved, stalled = [], []
        with self.index.lock:
            for name in tier_names:
                q = self.queues[name]
                while q.pending_bytes > 0 and q.pending_bytes + size > self.max_pending_bytes:
                    if self._stalled(q, time.monotonic()):
                        break
                    with self.hurry():
                        self.index.changed.wait(timeout=max(self.stall_s / 4, 0.01))
                    self.index.check_open()
                (reserved if self._take(q, size) else stalled).append(name)
        return Reservation(size, reserved, stalled)

    def try_reserve(self, size: int, tier_names: Sequence[str]) -> Reservation:
        """Room for ``size`` bytes in each named queue that has it now, without waiting (index
        lock held): for copies nobody waits for."""
        return Reservation(size, [name for name in tier_names if self._take(self.queues[name], size)], [])

    def _take(self, q: _Queue, size: int) -> bool:
        """Room for ``size`` bytes in ``q`` if it has it and its tier is not stalled (index
        lock held)."""
        if self._stalled(q, time.monotonic()) or (q.pending_bytes > 0 and
                                                  q.pending_bytes + size > self.max_pending_bytes):
            return False
        q.pending_bytes += size
        return True

    def release(self, reservation: Reservation) -> None:
        with self.index.lock:
            for name in reservation.tiers:
                self.queues[name].pending_bytes -= reservation.size
            reservation.tiers = []
            self.index.changed.notify_all()

    # -- queueing (index lock held) -------------------------------------------------------------

    @staticmethod
    def done_there(tier: Tier, replica: Replica | None, durable: bool) -> bool:
        """Whether a put may count ``replica`` (the tier's known current copy) as its copy
        without touching the tier: on a private tier, any for a plain put, a synced one for a
        durable put. A shared medium can lose a value or hold a peer's blob in its place
        without this index knowing (another daemon's delete or put, the cluster ledger's
        eviction, Redis's own), so there the copy job looks before it trusts it."""
        return replica is not None and not tier.shared and (replica.synced or not durable)

    def rechecks(self, entry: Entry) -> list[str]:
        """The shared tiers where the index lists a copy of ``entry``'s latest blob, which a
        re-put's copy job looks at (index lock held)."""
        return [name for name, q in self.queues.items() if q.tier.shared and entry.known_current(name) is not None]

    def queue(self, key_id: bytes, entry: Entry, reservation: Reservation, ticket: Ticket | None,
              only: Sequence[str] | None = None) -> None:
        """Queue the copies ``entry``'s latest version still needs (index lock held), using
        the reserved room; with a ticket, also syncs of copies written without one; with
        ``only``, copies to those tiers alone (the rest of the room is given back). ``entry``
        must be the key's entry in the index now."""
        assert self.index.get(key_id) is entry, "copies queued for an entry no longer in the index"
        wake = False  # whether a waiter on the index can act on what this call changed
        for name, q in self.queues.items():
            reserved = name in reservation.tiers
            current = entry.known_current(name)
            job = None
            wanted = only is None or name in only
            if wanted and not self.done_there(q.tier, current, ticket is not None):
                job = q.waiting.get(key_id)
                if job is not None and job.entry is not entry:
                    job = None
                if job is not None:  # not started: it copies the newest version when it runs
                    wake |= entry.size < job.size  # room given back
                    q.pending_bytes += entry.size - job.size
                    job.size = entry.size
                elif reserved:
                    wake |= not self._waited_for(q)
                    job = q.waiting[key_id] = CopyJob(key_id, entry, reservation.size, time.monotonic() + self.delay_s)
                    q.waiting.move_to_end(key_id)  # the queue stays in the order of due times
                    self.index.copy_queued(key_id, entry)
                    reserved = False  # the room is the job's now
                else:
                    self.dropped += 1
                    if ticket is not None:
                        ticket.fail(TierUnavailable(f"{name}: write-behind is stalled (no copy done for "
                                                    f"{self.stall_s:g} s); the chunk is not on this tier"))
            if reserved:
                q.pending_bytes -= reservation.size
                wake = True  # room given back: a put may wait for it
            if job is not None and ticket is not None:
                job.tickets.append(ticket)
                ticket.expect()
                wake = True  # a durable put's copy is taken at once
                if key_id in q.waiting:  # a durable put waits for it: it goes first, at once
                    q.waiting.move_to_end(key_id, last=False)
        reservation.tiers = []
        self.index.sync(key_id, entry)
        if wake:
            self.index.changed.notify_all()

    def _waited_for(self, q: _Queue) -> bool:
        """Whether ``q``'s idle workers already wait for a job that falls due no later than one
        queued now (index lock held): a waiting job whose key has no copy running, while
        copies are not hurried (``_next``). Then a new job wakes nobody: a put that woke them
        all for nothing, each to find it not due, spent ~65 us of its ~130 (without its copy)
        waiting for the interpreter lock they took."""
        return not (self._hurry or self._closing) and any(key_id not in q.running for key_id in q.waiting)

    def cancel(self, key_id: bytes, entry: Entry) -> list[str]:
        """Forget the waiting copies of a deleted entry (index lock held); returns the tiers
        where one is running (the deleter waits for it through the key lock)."""
        running = []
        for name, q in self.queues.items():
            job = q.waiting.get(key_id)
            if job is not None and job.entry is entry:
                del q.waiting[key_id]
                q.pending_bytes -= job.size
                self.index.copy_done(key_id, entry)
                for ticket in job.tickets:
                    ticket.finish(None)  # a delete supersedes the put
            job = q.running.get(key_id)
            if job is not None and job.entry is entry:
                running.append(name)
        self.index.changed.notify_all()
        return running

    def shed_stalled(self) -> bool:
        """Drop the copies waiting for stalled tiers (index lock held), so that their chunks'
        first-tier pages can be evicted: call only when a put needs room in the first tier
        that only such chunks hold, since a hung tier must not stop puts (review #13). Copies
        already running stay (they hold their chunk's pages until the tier answers). Like a
        copy skipped at put time, each is counted in ``dropped`` and fails its durable puts;
        the replica is simply not made. Returns whether any was dropped."""
        now, shed = time.monotonic(), False
        for name, q in self.queues.items():
            if not self._stalled(q, now) or not q.waiting:
                continue
            error = TierUnavailable(f"{name}: write-behind is stalled (no copy done for {self.stall_s:g} s); the copy "
                                    f"was dropped to make room in {self.first.name}")
            log.warning("%s: write-behind is stalled (no copy done for %g s): %d waiting copies dropped to give "
                        "%s room to a put", name, self.stall_s, len(q.waiting), self.first.name)
            for key_id, job in list(q.waiting.items()):
                del q.waiting[key_id]
                q.pending_bytes -= job.size
                self.index.copy_done(key_id, job.entry)
                self.dropped += 1
                for ticket in job.tickets:
                    ticket.finish(error)
            shed = True
        if shed:
            self.index.changed.notify_all()
        return shed

    def busy(self, key_id: bytes) -> bool:
        return any(key_id in q.waiting or key_id in q.running for q in self.queues.values())

    # -- workers ----------------------------------------------------------------------------

    def _next(self, q: _Queue) -> CopyJob | None:
        """The first waiting job that is due (or waited for) whose key has none running (lock
        held); None when closing and nothing is left. Durable puts' jobs lead the queue, the
        rest follow in the order they fall due."""
        while True:
            now = time.monotonic()
            hurried = self._hurry > 0 or self._closing
            wake = None
            for key_id, job in q.waiting.items():
                if key_id in q.running:
                    continue
                if not (hurried or job.tickets or job.due <= now):
                    wake = job.due - now  # the jobs behind it fall due later
                    break
                del q.waiting[key_id]
                if not q.running:
                    q.last_progress = time.monotonic()  # the stall clock runs while copies are in flight
                q.running[key_id] = job
                return job
            if self._closing and not q.waiting:
                return None
            self.index.changed.wait(timeout=wake)

    @contextmanager
    def hurry(self) -> Iterator[None]:
        """While inside, workers take waiting copies without their delay (index lock held on
        entry; the caller waits on ``index.changed``, which releases it)."""
        self._hurry += 1
        self.index.changed.notify_all()
        try:
            yield
        finally:
            self._hurry -= 1

    def _work(self, q: _Queue) -> None:
        lower_priority(self._nice)
        while True:
            with self.index.lock:
                job = self._next(q)
            if job is None:
                return
            try:
                self._copy(q, job)
            except Exception:  # a bug: the job must still end, or its putters wait forever
                log.exception("%s: copy of %s failed unexpectedly", q.tier.name, job.key_id.hex())
                with self.index.lock:
                    if job.key_id in q.running:
                        self._finish(q, job, None, TierError("copy failed unexpectedly"))

    def _copy(self, q: _Queue, job: CopyJob) -> None:
        """Write one chunk's first-tier copy to ``q.tier``. The first tier's value is pinned
        under its key lock, so it is exactly the replica the index lists; a re-put after that
        makes this copy a stale replica that the newer job replaces."""
        tier, key_id, entry = q.tier, job.key_id, job.entry
        # a re-put's copy to a shared tier writes the value again unless the medium holds the very
        # blob the index lists: a peer may have deleted it, or replaced it with its own put's. A
        # durable put's copy reads it whole: a sync alone must not acknowledge a payload damaged
        # since it was written
        self._evictor.wait_profiles()  # the copy's encoding is chosen with them
        with self.index.lock:
            listed = tier.shared and entry.known_current(tier.name) is not None
        there = None  # absent, unreadable or damaged, or not looked at (a first copy)
        if listed:
            there = verified_header(tier, key_id) if job.tickets else peek_header(tier, key_id)
        with ExitStack() as stack:
            with self.locks.hold(self.first.name, key_id):
                with self.index.lock:
                    live = self.index.get(key_id) is entry
                    source = entry.current(self.first.name) if live else None
                    target = entry.known_current(tier.name) if live else None
                    if tier.shared and target is not None and not target.is_blob(there):
                        target = None
                    sync = bool(job.tickets)
                    codec = self._evictor.write_codec(tier, entry, source) if live and target is None and source is not None else None
                views = None
                if live and target is None and source is not None:
                    views = stack.enter_context(self.first.pinned(key_id))
            if not live:
                with self.index.lock:
                    self._finish(q, job, None, None)
                return
            if target is not None:  # already there (a re-put): a durable one makes it durable
                self._sync_only(q, job, target, sync)
                return
            if views is None or sum(len(v) for v in views) != source.size:
                with self.index.lock:
                    self._finish(q, job, None, TierError(f"{self.first.name}: the chunk's copy is gone; nothing to copy"))
                return
            replica = Replica(source.size, source.codec_id, source.version, checksum=source.checksum)
            try:
                recoded = self._encode(tier, key_id, views, codec, replica) if codec is not None else None
            except CorruptBlob as exc:  # never spread a copy found corrupt, nor keep it
                stack.close()
                self.io.corrupt(key_id, self.first, source, exc)
                with self.index.lock:
                    self._finish(q, job, None, TierError(f"{self.first.name}: the chunk's copy is corrupt ({exc}); "
                                                         "it was dropped, not copied"))
                return
            if recoded is not None:
                views, replica = recoded
            self._write(q, job, views, replica, sync, recoded is not None)

    @staticmethod
    def _encode(tier: Tier, key_id: bytes, views, codec: Codec, source: Replica):
        """The pinned first-tier copy verified, decoded and encoded by ``codec``, as (parts,
        replica), or None (logged) to write the put's encoding instead; CorruptBlob if the
        copy fails verification."""
        header, payload = verify_blob(b"".join(views))
        try:
            tensor = codec_by_id(header.codec_id).decode(payload, header.shape, header.dtype)
            encoded = codec.encode(tensor)
        except (CorruptBlob, ValueError, KeyError) as exc:
            log.warning("%s: encoding the copy of %s as %s failed (%s); writing it as put", tier.name,
                        key_id.hex(), codec.name, exc)
            return None
        parts = [reencoded_header(header, codec.codec_id, encoded), encoded]
        return parts, Replica.of(decode_header(parts[0]), sum(len(p) for p in parts), source.version)

    def _write(self, q: _Queue, job: CopyJob, views, replica: Replica, sync: bool, recoded: bool = False) -> None:
        """Make room and write; room is made without the key lock, the write under it, and a
        worker that finds the room taken meanwhile makes room again. A TierFull while the
        tier's own count shows room is the medium's (file system full, Redis out of memory)."""
        tier, key_id = q.tier, job.key_id
        need = tier.footprint(replica.size)
        while True:
            error = None
            try:
                self._evictor.make_room(tier, need, exclude=key_id)
            except TierError as exc:
                error = exc
            with self.locks.hold(tier.name, key_id):
                if error is None:
                    with self.index.lock:
                        # deleted while room was made (without the key lock): its deleter found no
                        # copy running to wait for, and returned; nothing may write it now
                        live = self.index.get(key_id) is job.entry
                        old = job.entry.replicas.get(tier.name)
                        sync = sync or (old is not None and (old.synced or old.found))  # never downgrade a synced file
                    if not live:
                        with self.index.lock:
                            self._finish(q, job, None, None)
                        return
                    written = False
                    try:
                        tier.write(key_id, views)
                        written = True
                        if sync:
                            tier.sync(key_id)
                        self.io.published(tier, key_id, replica.size)
                    except TierFull as exc:
                        if not written and tier.capacity_bytes - tier.used_bytes < need:
                            continue
                        error = exc
                    except (TierError, OSError) as exc:
                        error = exc
                else:
                    written = False
                # a copy written whose sync failed is on the tier all the same (unsynced): the
                # index lists it, so that eviction and delete find it; its put still fails
                written_replica = dataclasses.replace(replica, synced=sync and error is None) if written else None
                with self.index.lock:
                    if recoded and error is None:
                        self.index.count(tier.name, recodes=1)
                    deleted = self._finish(q, job, written_replica, error, wrote=written)
                if deleted:
                    self.io.delete_held(tier, key_id)
            return

    def _sync_only(self, q: _Queue, job: CopyJob, target: Replica, sync: bool) -> None:
        tier, key_id = q.tier, job.key_id
        error = None
        with self.locks.hold(tier.name, key_id):
            if sync and not target.synced:
                try:
                    tier.sync(key_id)
                except (TierError, OSError) as exc:
                    error = exc
            with self.index.lock:
                if error is None and sync:
                    self.index.mark_synced(job.entry, tier.name, target)
                self._finish(q, job, None, error)

    def _finish(self, q: _Queue, job: CopyJob, replica: Replica | None, error: Exception | None,
                wrote: bool = False) -> bool:
        """End a job (index lock held, and the tier's key lock if it wrote). Returns True if
        the value it wrote must go: its chunk was deleted meanwhile."""
        tier, key_id, entry, index = q.tier, job.key_id, job.entry, self.index
        q.running.pop(key_id, None)
        q.pending_bytes -= job.size
        q.last_progress = time.monotonic()
        live = index.get(key_id) is entry
        if error is not None:
            index.count(tier.name, errors=1)
            self.dropped += 1
            log.warning("%s: copy of %s failed: %s", tier.name, key_id.hex(), error)
        elif wrote:
            index.count(tier.name, bytes_written=replica.size)
        index.copy_done(key_id, entry, tier.name, replica)
        for ticket in job.tickets:
            ticket.finish(error)
        return wrote and not live

    # -- waiting -------------------------------------------------------------------------------

    def pending_bytes(self) -> int:
        return sum(q.pending_bytes for q in self.queues.values())

    def queued(self) -> int:
        return sum(len(q.waiting) + len(q.running) for q in self.queues.values())

    def progressing(self) -> bool:
        """Copies are queued on a tier that is not stalled: room held by their chunks in the
        first tier will come free (index lock held). Copies waiting for a worker count as
        progressing: only a tier's own work in flight can stall it."""
        now = time.monotonic()
        return any((q.waiting or q.running) and not self._stalled(q, now) for q in self.queues.values())

    def wait_moving(self, key_ids: Sequence[bytes]) -> None:
        """Wait until no copy of ``key_ids`` is queued or running on a tier that makes progress:
        a copy on a stalled tier (none done for ``stall_s``) is not waited for, so a hung tier
        holds a caller for ``stall_s`` at most."""
        with self.index.lock, self.hurry():
            while True:
                now = time.monotonic()
                if not any((k in q.waiting or k in q.running) and not self._stalled(q, now)
                           for q in self.queues.values() for k in key_ids):
                    return
                self.index.changed.wait(timeout=max(self.stall_s / 4, 0.01))

    def wait_idle(self, key_ids: Sequence[bytes] | None = None, timeout_s: float | None = None) -> bool:
        """Wait until no copy is queued or running (of ``key_ids``, or at all); False on timeout."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self.index.lock, self.hurry():
            while (self.pending_bytes() > 0 if key_ids is None else any(self.busy(k) for k in key_ids)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.index.changed.wait(timeout=0.5 if left is None else min(left, 0.5))
        return True

    def close(self) -> None:
        """Stop the workers once the queues are empty (call after ``wait_idle``)."""
        with self.index.lock:
            self._closing = True
            self.index.changed.notify_all()
        for t in self._threads:
            t.join()
