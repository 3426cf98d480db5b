"""The shared-memory slot arena: fixed-size slots in one /dev/shm file, leased to clients.

Slots are staging buffers: a client writes a blob into its slot and the daemon copies it
into the store only after verifying it (Put: a client never writes into the store's own
pages), or the daemon places a chunk in the client's slot (Get of a chunk that is not raw
in host RAM: encoded, or on a slower tier). Raw chunks in host RAM need no slot when the
daemon shares its host pool (``shm.share_host_pool``): the client maps the pool read-only
and copies them out itself. Neither file widens who can read what: both are 0600, so only
processes of the daemon's own user map them, and such a process can read any slot anyway.

Safety: a slot belongs to at most one lease at a time; every reference names the lease (a
random 63-bit id), the slot index and the slot's generation, which is bumped whenever the
slot changes hands, so a stale or forged reference is rejected. A lease unused for
``lease_ttl_s`` is reclaimed, unless one of its slots is being copied right now.
Used only from the event loop thread (no locks); copies run in the executor while the
slot is marked busy.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

from kvstore.wire.frames import NONCE_BYTES

ARENA_HEADER_BYTES = 4096


PREFIXES = ("kvstore-slots-", "kvstore-pool-")  # slot arenas, shared host pools


def shm_file_path(directory: str, prefix: str) -> str:
    """A new file name under ``directory`` that names this process (see ``remove_orphans``)."""
    return os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(6)}")


def remove_orphans(directory: str) -> None:
    """Delete arenas and pools left by daemons that died without cleaning up (kill -9)."""
    for name in os.listdir(directory):
        prefix = next((p for p in PREFIXES if name.startswith(p)), None)
        if prefix is None:
            continue
        pid = name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass


class SlotError(Exception):
    """A slot reference is unusable; ``kind`` picks the gRPC status."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "stale" | "forged" | "range" | "exhausted"


@dataclass
class Lease:
    lease_id: int
    slots: list[int]
    expires: float
    busy: int = 0


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
        remove_orphans(self.dir)
        self.path = shm_file_path(self.dir, PREFIXES[0])
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, ARENA_HEADER_BYTES + self.slots * self.slot_bytes)
            self._mmap = mmap.mmap(fd, ARENA_HEADER_BYTES + self.slots * self.slot_bytes, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._mmap[:NONCE_BYTES] = self.nonce
        self._view = memoryview(self._mmap)
        self._free: deque[int] = deque(range(self.slots))
        self._generation = [0] * self.slots
        self._owner = [0] * self.slots
        self._leases: dict[int, Lease] = {}

    def offset(self, index: int) -> int:
        return ARENA_HEADER_BYTES + index * self.slot_bytes

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def lease(self, count: int) -> Lease:
        self.expire()
        count = min(max(1, count), self.max_slots_per_lease)
        if len(self._free) < count:
            raise SlotError("exhausted", f"{len(self._free)} shared-memory slots free, {count} asked")
        lease_id = secrets.randbits(63) or 1
        slots = [self._free.popleft() for _ in range(count)]
        for i in slots:
            self._generation[i] += 1
            self._owner[i] = lease_id
        lease = self._leases[lease_id] = Lease(lease_id, slots, time.monotonic() + self.lease_ttl_s)
        return lease

    def generation(self, index: int) -> int:
        return self._generation[index]

    def renew(self, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise SlotError("stale", f"lease {lease_id} is unknown or expired")
        lease.expires = time.monotonic() + self.lease_ttl_s
        return lease

    def release(self, lease_id: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None and not lease.busy:
            self._reclaim(lease)

    def _reclaim(self, lease: Lease) -> None:
        del self._leases[lease.lease_id]
        for i in lease.slots:
            self._generation[i] += 1
            self._owner[i] = 0
            self._free.append(i)

    def expire(self) -> int:
        now = time.monotonic()
        dead = [lease for lease in self._leases.values() if lease.expires <= now and not lease.busy]
        for lease in dead:
            self._reclaim(lease)
        return len(dead)

    def _check(self, lease_id: int, index: int, generation: int, nbytes: int) -> Lease:
        if not 0 <= index < self.slots:
            raise SlotError("range", f"slot index {index} out of range (arena has {self.slots})")
        if nbytes > self.slot_bytes:
            raise SlotError("range", f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        lease = self._leases.get(lease_id)
        if lease is None or lease.expires <= time.monotonic():
            raise SlotError("stale", f"lease {lease_id} is unknown or expired")
        if self._owner[index] != lease_id:
            raise SlotError("forged", f"slot {index} does not belong to lease {lease_id}")
        if self._generation[index] != generation:
            raise SlotError("stale", f"slot {index} generation {generation} is stale (now {self._generation[index]})")
        return lease

    @contextmanager
    def using(self, refs: list[tuple[int, int, int]], nbytes: int):
        """Views of the referenced slots (each ``nbytes`` long), valid inside the block; the
        leases are renewed and cannot expire meanwhile."""
        leases = [self._check(lid, idx, gen, nbytes) for lid, idx, gen in refs]
        for lease in leases:
            lease.busy += 1
            lease.expires = time.monotonic() + self.lease_ttl_s
        try:
            yield [self._view[self.offset(idx) : self.offset(idx) + nbytes] for _, idx, _ in refs]
        finally:
            for lease in leases:
                lease.busy -= 1

    def close(self) -> None:
        self._view.release()
        try:
            self._mmap.close()
        except BufferError:
            pass  # an executor thread still holds a view; the mapping goes with it
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
