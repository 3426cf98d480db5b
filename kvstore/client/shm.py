"""This client's lease on the daemon's slot arena (and its read-only map of the host pool).

Who may write a slot, and until when: this client, until it names the slot in a request;
the daemon, from then until the request is answered. A slot whose request did not end with
an answer (a timeout, a cancellation, a broken connection) may still be written by the
daemon, so it is never handed out again: the whole lease is retired, released at the
client's next call (the daemon reclaims it once it is done with it), and a new one leased.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from kvstore._proto import kvstore_pb2 as pb
from kvstore.wire.frames import NONCE_BYTES


class ShmLease:
    def __init__(self, reply: pb.LeaseReply) -> None:
        fd = os.open(reply.path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if self._mmap[:NONCE_BYTES] != reply.nonce:
            self._mmap.close()
            raise OSError(f"{reply.path} is not the daemon's arena (nonce differs)")
        self.pool: memoryview | None = None  # the daemon's host pool, read-only, when it shares it
        if reply.pool_path:
            fd = os.open(reply.pool_path, os.O_RDONLY)
            try:
                self.pool = memoryview(mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
            finally:
                os.close(fd)
        self.lease_id = reply.lease_id
        self.slot_bytes = reply.slot_bytes
        self.ttl_s = reply.ttl_s
        self.retired = False
        self._last_use = time.monotonic()
        view = memoryview(self._mmap)
        self._free = [(ref, view[offset : offset + reply.slot_bytes]) for ref, offset in zip(reply.slots, reply.offsets)]
        self._lock = threading.Lock()

    def take(self, want: int) -> list:
        """Up to ``want`` free slots, as (SlotRef, view) pairs; none if all are busy."""
        with self._lock:
            taken, self._free = self._free[:want], self._free[want:]
        return taken

    def give(self, slots: list) -> None:
        """Slots whose requests were answered."""
        with self._lock:
            if not self.retired:
                self._free.extend(slots)

    def fresh(self) -> bool:
        """Used recently enough to skip renewing before use (any use renews it)."""
        return time.monotonic() - self._last_use <= self.ttl_s / 2

    def touch(self) -> None:
        self._last_use = time.monotonic()
