"""This client's lease on the daemon's slot arena (and its read-only map of the host pool).

Who may write a slot, and until when: this client, until it names the slot in a request;
the daemon, from then until the request is answered; then this client again, which copies a
Get's chunks out of their slots after the last reply. A slot whose request did not end with
an answer (a timeout, a cancellation, a broken connection) may still be written by the
daemon, so it is never handed out again: the whole lease is retired (``take`` hands out no
more of its slots) and a new one leased. A retired lease is released only once every slot
taken from it has come back, at the client's next call after that (the daemon reclaims it
once its own copies are done): released sooner, the daemon could lease a slot to anybody
while another call of this client still copied a chunk out of it, or a blob into it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time

from kernels import host_register
from kvstore.wire._proto import kvstore_pb2 as pb
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
        self.retired = False  # set under ``_lock`` (``retire``): from then on ``take`` hands out nothing
        self._out = 0  # slots taken and not given back: requests of this client still use them
        self._renewed = time.monotonic()  # the daemon renewed the lease before this (Lease, RenewLease)
        view = memoryview(self._mmap)
        self._free = [(ref, view[offset : offset + reply.slot_bytes]) for ref, offset in zip(reply.slots, reply.offsets)]
        self._lock = threading.Lock()
        self._cuda_maps: list[int] = []  # addresses of the maps registered with CUDA
        self._cuda_refused = False

    def register_with_cuda(self) -> bool:
        """Page-lock both maps (the arena, and the daemon's pool read-only) for CUDA's copy
        engines (kernels/host_register.py), once, so a chunk handed over from either goes to
        the GPU by DMA with no staging copy; whether they are (False without the pool, without
        CUDA, or where the driver refuses: then it is not asked again). Undone by
        ``unregister_from_cuda``."""
        with self._lock:
            if not self._cuda_maps and not self._cuda_refused and self.pool is not None and not self.retired:
                for buf, what, read_only in ((self._mmap, "the daemon's slot arena", False),
                                             (self.pool, "the daemon's host pool", True)):
                    address = host_register.register(buf, what, read_only)
                    if address is None:
                        self._cuda_refused = True
                        self._unregister()
                        break
                    self._cuda_maps.append(address)
            return bool(self._cuda_maps)

    def unregister_from_cuda(self) -> None:
        """Undo ``register_with_cuda``, once nothing copies from the maps any more (every slot
        taken from this lease came back: a chunk is handed over while its slot is out)."""
        with self._lock:
            self._unregister()

    def _unregister(self) -> None:
        for address in self._cuda_maps:
            host_register.unregister(address)
        self._cuda_maps = []

    def take(self, want: int) -> list:
        """Up to ``want`` free slots, as (SlotRef, view) pairs; none if all are busy or the
        lease is retired."""
        with self._lock:
            if self.retired:
                return []
            taken, self._free = self._free[:want], self._free[want:]
            self._out += len(taken)
        return taken

    def give(self, slots: list) -> None:
        """Slots this client no longer touches: their request is over, answered or not."""
        with self._lock:
            self._out -= len(slots)
            if not self.retired:
                self._free.extend(slots)

    def retire(self) -> bool:
        """Hand out no more slots; False if it was retired already."""
        with self._lock:
            was, self.retired = self.retired, True
        return not was

    def releasable(self) -> bool:
        """Retired, and every slot taken from it has come back."""
        with self._lock:
            return self.retired and self._out == 0

    def fresh(self) -> bool:
        """Renewed recently enough to use without renewing first. Only a renewal this client
        saw answered counts: whether the daemon counted a use as one is not known here (a Get
        answered from the host pool copies into no slot), and a lease the daemon reclaimed
        while this client thought it fresh has slots another client may own by now."""
        return time.monotonic() - self._renewed <= self.ttl_s / 2

    @staticmethod
    def clock() -> float:
        return time.monotonic()

    def renewed(self, asked: float) -> None:
        """The daemon answered a RenewLease sent at ``asked`` (``clock()``)."""
        self._renewed = asked
