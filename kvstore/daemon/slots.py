"""The shared-memory slot arena: fixed-size slots in one /dev/shm file, leased to clients.

Slots are staging buffers. Put: the client writes a blob into its slot and names the slot;
the daemon copies it out into private memory before verifying it, so a client that keeps
writing into its slot can spoil only that one Put. Get: the daemon places a chunk in the
client's slot (one that is not raw in host RAM, or for a client without pool views); the
Store itself never reads into a slot, so its checksums and promotions only ever see memory
no client can write. Raw chunks in host RAM need no slot when the daemon shares its host pool
(``shm.share_host_pool``): the client maps the pool read-only and copies them out itself.

Who may write a slot, and until when: the client, until it names the slot in a request; the
daemon, from then until it answers. A slot serves one request at a time (a second request
naming a busy slot fails, ABORTED), and stays busy until the daemon's copy into or out of it
has finished, even if the request was cancelled or timed out meanwhile (the service fences
the executor's work before leaving ``using``). A lease released or expired while busy is
reclaimed when its last copy ends, never before.

References: every reference names the lease (a random 63-bit id), the slot index and the
slot's generation, bumped whenever the slot changes hands, so a stale or forged reference is
rejected; a lease belongs to the tenant that took it, and nobody else may use or release it.
A lease unused for ``lease_ttl_s`` is reclaimed (never while busy: a use renews it). Used only from the event loop thread (no
locks); copies run in the executor while their slots are busy.
"""

from __future__ import annotations

import mmap
import secrets
import time
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvstore.daemon.shmfiles import ARENA, SharedFile
from kvstore.wire.frames import NONCE_BYTES

ARENA_HEADER_BYTES = 4096
ABANDONED_KEPT = 4096  # Lease requests released before they came, remembered (the oldest go first)


class SlotError(Exception):
    """A slot reference is unusable; ``kind`` picks the gRPC status."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "stale" | "forged" | "range" | "exhausted" | "busy" | "abandoned"


@dataclass
class Lease:
    lease_id: int
    slots: list[int]
    expires: float
    owner: str  # the tenant that took it
    request_id: int = 0  # the client's name for the Lease request (0: none)
    busy: int = 0
    ended: bool = False  # released or expired; reclaimed once ``busy`` is 0


@dataclass
class SlotArena:
    dir: str
    slots: int
    slot_bytes: int
    lease_ttl_s: float
    max_slots_per_lease: int
    path: str = field(init=False)
    nonce: bytes = field(init=False)

    def __post_init__(self) -> None:
        if self.slot_bytes <= 0 or self.slot_bytes % mmap.PAGESIZE:
            raise ValueError(f"shm.slot_bytes must be a positive multiple of {mmap.PAGESIZE}")
        if self.slots <= 0:
            raise ValueError("shm.slots must be positive")
        size = ARENA_HEADER_BYTES + self.slots * self.slot_bytes
        self._file = SharedFile(self.dir, ARENA, size)
        self.path = self._file.path
        self._mmap = mmap.mmap(self._file.fd, size, flags=mmap.MAP_SHARED)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._mmap[:NONCE_BYTES] = self.nonce
        self._view = memoryview(self._mmap)
        self._free: deque[int] = deque(range(self.slots))
        self._generation = [0] * self.slots
        self._owner = [0] * self.slots
        self._in_use = [False] * self.slots
        self._leases: dict[int, Lease] = {}
        self._requested: dict[tuple[str, int], Lease] = {}  # (owner, request id) of the live leases
        # (owner, request id) of Lease requests their client gave up on before they came: expiry
        self._abandoned: OrderedDict[tuple[str, int], float] = OrderedDict()

    def offset(self, index: int) -> int:
        return ARENA_HEADER_BYTES + index * self.slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def lease(self, count: int, owner: str, request_id: int = 0) -> Lease:
        self.expire()
        if (owner, request_id) in self._abandoned:
            raise SlotError("abandoned", f"lease request {request_id} was released by its client before it came")
        count = min(max(1, count), self.max_slots_per_lease)
        if len(self._free) < count:
            raise SlotError("exhausted", f"{len(self._free)} shared-memory slots free, {count} asked")
        lease_id = secrets.randbits(63) or 1
        slots = [self._free.popleft() for _ in range(count)]
        for i in slots:
            self._generation[i] += 1
            self._owner[i] = lease_id
        lease = self._leases[lease_id] = Lease(lease_id, slots, time.monotonic() + self.lease_ttl_s, owner, request_id)
        if request_id:
            self._requested[(owner, request_id)] = lease
        return lease

    def generation(self, index: int) -> int:
        return self._generation[index]

    def _live(self, lease_id: int, owner: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None or lease.ended or lease.owner != owner:
            raise SlotError("stale", f"lease {lease_id} is unknown or expired")
        return lease

    def renew(self, lease_id: int, owner: str) -> Lease:
        lease = self._live(lease_id, owner)
        lease.expires = time.monotonic() + self.lease_ttl_s
        return lease

    def release(self, lease_id: int, owner: str) -> None:
        """End a lease; its slots come back once no copy into or out of them is running."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.owner == owner:
            self._end(lease)

    def release_request(self, request_id: int, owner: str) -> None:
        """End the lease granted to ``owner``'s Lease request ``request_id``: the client never
        had the reply. Not granted yet (the request still on its way, or refused), it never
        will be: the request is remembered for two lease lifetimes, as long as any request
        that outlived its client's deadline may still come."""
        lease = self._requested.get((owner, request_id))
        if lease is not None:
            self._end(lease)
            return
        self._abandoned[(owner, request_id)] = time.monotonic() + 2 * self.lease_ttl_s
        if len(self._abandoned) > ABANDONED_KEPT:
            self._abandoned.popitem(last=False)

    def _end(self, lease: Lease) -> None:
        lease.ended = True
        self._requested.pop((lease.owner, lease.request_id), None)
        if lease.busy == 0:
            del self._leases[lease.lease_id]
            for i in lease.slots:
                self._generation[i] += 1
                self._owner[i] = 0
                self._free.append(i)

    def expire(self) -> int:
        now = time.monotonic()
        while self._abandoned and next(iter(self._abandoned.values())) <= now:
            self._abandoned.popitem(last=False)
        dead = [lease for lease in self._leases.values() if lease.expires <= now and not (lease.ended or lease.busy)]
        for lease in dead:
            self._end(lease)
        return len(dead)

    def _check(self, ref: tuple[int, int, int], nbytes: int, owner: str) -> Lease:
        lease_id, index, generation = ref
        if not 0 <= index < self.slots:
            raise SlotError("range", f"slot index {index} out of range (arena has {self.slots})")
        if nbytes > self.slot_bytes:
            raise SlotError("range", f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        lease = self._leases.get(lease_id)
        if lease is None or lease.ended or lease.expires <= time.monotonic() or lease.owner != owner:
            raise SlotError("stale", f"lease {lease_id} is unknown or expired")
        if self._owner[index] != lease_id:
            raise SlotError("forged", f"slot {index} does not belong to lease {lease_id}")
        if self._generation[index] != generation:
            raise SlotError("stale", f"slot {index} generation {generation} is stale (now {self._generation[index]})")
        if self._in_use[index]:
            raise SlotError("busy", f"slot {index} is in use by another request")
        return lease

    def check(self, refs: list[tuple[int, int, int]], nbytes: int, owner: str) -> None:
        """SlotError unless every ref names a live slot of one of ``owner``'s leases, free now.
        A Get that answers with pool views writes no slot, but the client reads the pool
        through the mapping it took with the lease: a lease this daemon does not know (the
        client's, from before a restart) maps another pool, whose bytes at those offsets
        are another chunk's."""
        leases = [self._check(ref, nbytes, owner) for ref in refs]
        expires = time.monotonic() + self.lease_ttl_s
        for lease in leases:  # a request naming a lease's slots uses it, whether or not it copies
            lease.expires = expires  # into one (a Get answered from the host pool writes none)

    def check_lease(self, lease_id: int, owner: str) -> None:
        """SlotError unless ``lease_id`` is a live lease of ``owner``; it is used now (its
        expiry renewed). A Get answered with pool views without slots names the lease whose
        pool mapping the client reads through, for the reason ``check`` gives."""
        lease = self._leases.get(lease_id)
        if lease is None or lease.ended or lease.expires <= time.monotonic() or lease.owner != owner:
            raise SlotError("stale", f"lease {lease_id} is unknown or expired")
        lease.expires = time.monotonic() + self.lease_ttl_s

    @contextmanager
    def using(self, refs: list[tuple[int, int, int]], nbytes: int, owner: str):
        """Views of the referenced slots (each ``nbytes`` long), for the daemon alone inside
        the block: each slot serves one request at a time, and its lease cannot be reclaimed
        meanwhile. Leave the block only once nothing writes into or reads out of the views."""
        indexes = [ref[1] for ref in refs]
        if len(set(indexes)) != len(indexes):
            raise SlotError("busy", "a request names one slot twice")
        leases = [self._check(ref, nbytes, owner) for ref in refs]
        now = time.monotonic()
        for lease, index in zip(leases, indexes):
            lease.busy += 1
            lease.expires = now + self.lease_ttl_s
            self._in_use[index] = True
        try:
            yield [self._view[self.offset(i) : self.offset(i) + nbytes] for i in indexes]
        finally:
            now = time.monotonic()
            for lease, index in zip(leases, indexes):
                self._in_use[index] = False
                lease.busy -= 1
                lease.expires = now + self.lease_ttl_s  # a use renews the lease
                if lease.ended:
                    self._end(lease)

    def close(self) -> None:
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # an executor thread still holds a view; the mapping goes with it
        self._file.close()
