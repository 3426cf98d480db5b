"""The chunks a Get names, read for the gRPC stream or a bulk channel.

Each chunk is read in an executor thread as a piece of its tenant's work (tenant_work.py),
at most ``limits.get_read_ahead`` ahead of the one being sent, fenced (reads.py): into a
client's slot, a pooled buffer, or pinned where it lies raw in the host pool. The leading
chunks that lie raw there are pinned first, all together: a few on the event loop, where a
pin touches only memory, the rest in one executor call. Nothing is sized by a request
before its chunk is known to exist (``Store.read_into`` takes the buffer only then), and a
miss is one Store call, which counts it.
"""

from __future__ import annotations


import grpc
import numpy as np
import torch

from kernels.parallel_copy import copy, copy_pairs
from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.blob import HEADER_BYTES, decode_header
from kvstore.daemon.admission import Admission
from kvstore.daemon.buffers import BufferPool
from kvstore.daemon.bulk_channel import Channel
from kvstore.daemon.config import LimitsConfig
from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.read_grants import ReadGrants
from kvstore.daemon.reads import Read, ReadAhead
from kvstore.daemon.slots import SlotArena
from kvstore.daemon.tenancy import Bound
from kvstore.daemon.tenant_work import TenantWork
from kvstore.keys import ChunkKey
from kvstore.store import Store

# Leading chunks of a Get pinned on the event loop, where a pin touches only memory (a lend
# that hashes no payload: ~25-50 us): a thread's round trip for them cost more (~270 us of
# a Get of 8 chunks' ~850 before its first reply). More are pinned in one executor call.
LOOP_PINS = 16


def copy_bytes(dst, src) -> None:
    copy(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))


def _copy_views(dst: memoryview, views: list[memoryview]) -> None:
    pairs, off = [], 0
    for v in views:
        pairs.append((np.frombuffer(dst[off : off + v.nbytes], dtype=np.uint8), np.frombuffer(v, dtype=np.uint8)))
        off += v.nbytes
    copy_pairs(pairs)


def need_arena(arena: SlotArena | None) -> SlotArena:
    if arena is None:
        raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is disabled on this daemon")
    return arena


class ChunkReads:
    def __init__(self, store: Store, pool: BufferPool, arena: SlotArena | None, pool_path: str | None,
                 limits: LimitsConfig, admission: Admission, read_grants: ReadGrants, metrics: DaemonMetrics,
                 work: TenantWork) -> None:
        self.store, self.pool, self.arena, self.pool_path, self.limits = store, pool, arena, pool_path, limits
        self.admission, self.read_grants, self.metrics, self.work = admission, read_grants, metrics, work

    def _read(self, bound: Bound, key: ChunkKey, payload: int, slot_view, hold: bool) -> Read | None:
        """Read one chunk (in an executor thread). ``hold``: answer with its pinned host-pool
        ranges if it lies there raw. Else into ``slot_view``, or into a pooled buffer
        (TENSOR) or as the blob (BLOB). None on a miss. The Store reads only into memory
        of the daemon's own; a slot gets a copy."""
        chunk_bytes = bound.chunk_bytes
        if payload == pb.TENSOR and (hold or slot_view is not None) and self.store.host_pool is not None:
            lent = self.store.lend(key)
            if lent is not None and hold:
                return Read(chunk_bytes, pool_runs=lent.runs, release=lent.release)
            if lent is not None:
                try:
                    _copy_views(slot_view, self.store.host_pool.views(lent.runs))
                finally:
                    lent.release()
                return Read(chunk_bytes)
        if payload == pb.TENSOR:
            taken = []

            def take() -> torch.Tensor:  # only once the chunk is known to exist: a request sizes nothing
                taken.append(self.pool.take(chunk_bytes))
                return torch.from_numpy(taken[0]).view(getattr(torch, bound.ns.dtype)).view(bound.ns.chunk_shape)

            if not self.store.read_into(key, take):
                for buf in taken:
                    self.pool.give(buf)
                return None
            (buf,) = taken
            if slot_view is None:
                return Read(chunk_bytes, data=buf, pooled=buf)
            copy_bytes(slot_view, buf)
            self.pool.give(buf)
            return Read(chunk_bytes)
        blob = self.store.get_blob(key)
        if blob is None:
            return None
        parts = [blob]
        if bound.rekeyed:
            payload_view = memoryview(blob)[HEADER_BYTES:]
            parts = [bound.header_for(decode_header(blob), payload_view, claimed=True), payload_view]
        if slot_view is None:
            return Read(len(blob), data=parts)
        if len(blob) > len(slot_view):
            raise Fail(grpc.StatusCode.OUT_OF_RANGE, f"blob of {len(blob)} bytes does not fit the slot")
        _copy_views(slot_view, [memoryview(p) for p in parts])
        return Read(len(blob))

    def _pin_leading(self, keys: list[ChunkKey], chunk_bytes: int, room: int) -> list[Read]:
        """Pins of the leading ``keys`` that lie raw in host RAM, up to ``room`` bytes; it stops
        at the first that does not."""
        if self.store.host_pool is None:
            return []
        return [Read(chunk_bytes, pool_runs=lent.runs, release=lent.release)
                for lent in self.store.lend_many(keys[: room // chunk_bytes])]

    async def _pin_all_leading(self, keys: list[ChunkKey], chunk_bytes: int, room: int, caller: Tenant) -> list[Read]:
        """``_pin_leading``: the first ``LOOP_PINS`` on the event loop where a pin hashes no
        payload, the rest (or all) in one executor call."""
        on_loop = 0 if self.store.lend_hashes_payloads else LOOP_PINS
        ready = []
        if on_loop:
            ready = await self.work.on_loop(caller.label, self._pin_leading, keys[:on_loop], chunk_bytes, room)
        if len(ready) < on_loop or len(keys) <= on_loop:
            return ready
        try:
            return ready + await self.work.run(caller.label, self._pin_leading, keys[on_loop:], chunk_bytes,
                                               room - on_loop * chunk_bytes,
                                               abandoned=lambda reads: [self.done(r) for r in reads])
        except BaseException:  # cancelled meanwhile, say: the pins made here go too
            for read in ready:
                self.done(read)
            raise

    async def _read_one(self, bound: Bound, key: ChunkKey, payload: int, slot, slot_bytes: int, hold: bool,
                        caller: Tenant):
        if slot is None:
            return await self.work.run(caller.label, self._read, bound, key, payload, None, hold, abandoned=self.done)
        with self.arena.using([(slot.lease_id, slot.index, slot.generation)], slot_bytes, caller.name) as (view,):
            return await self.work.run(caller.label, self._read, bound, key, payload, view, hold, abandoned=self.done)

    def done(self, read: Read | None) -> None:
        """Release what ``read`` holds."""
        if read is None:
            return
        if read.release is not None:
            read.release()
        if read.pooled is not None:
            self.pool.give(read.pooled)

    async def chunks(self, request, caller: Tenant, bound: Bound, keys: list[ChunkKey], channel: Channel | None = None):
        """Validate a GetRequest whose keys (``bound``) are ``keys``, then yield one ``Read``
        per chunk, in order, until the first miss. On a bulk ``channel``, chunks raw in the
        host pool come pinned; they stay so for a client that copies them out itself (pool
        views: the others go into its slots, or without slots over the socket) until its
        RELEASE. Anything else a chunk holds is released when the consumer
        asks for the next, unless the consumer took it over (``handover``)."""
        payload = request.payload
        if payload not in (pb.BLOB, pb.TENSOR):
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"unknown payload kind {payload}")
        slots = list(request.slots)
        slot_bytes = 0  # what each slot must hold
        if slots:
            arena = need_arena(self.arena)
            if len(slots) != len(keys):
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"{len(slots)} slots for {len(keys)} keys")
            slot_bytes = bound.chunk_bytes if payload == pb.TENSOR else arena.slot_bytes
            arena.check([(s.lease_id, s.index, s.generation) for s in slots], slot_bytes, caller.name)
        if request.pool_views and channel is None:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "pool_views needs a bulk channel")
        if request.pool_views and self.pool_path is None:
            raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "this daemon does not share its host pool")
        if request.pool_views and not slots:  # the slots' check names the lease otherwise
            need_arena(self.arena).check_lease(request.pool_lease, caller.name)
        # the socket of a bulk channel sends from the pool; a client that maps it copies from it
        holdable = payload == pb.TENSOR and channel is not None and (not slots or request.pool_views)
        chunk_bytes = bound.chunk_bytes
        depth = self.limits.get_read_ahead
        order = self.read_grants.next_get()

        async def start(i: int):  # at most max_pinned_bytes held, plus the reads ahead
            async with self.read_grants.hold(caller.name, order):  # tenants share; earlier Gets first
                hold = holdable and channel.can_pin(chunk_bytes)
                return await self._read_one(bound, keys[i], payload, slots[i] if slots else None, slot_bytes, hold,
                                            caller)

        with self.admission.add_bytes(caller, min(len(keys), depth) * chunk_bytes):
            ready = []
            if holdable:  # the leading chunks raw in host RAM: pinned together, not each in a read of its own
                ready = await self._pin_all_leading(keys, chunk_bytes, channel.max_pinned_bytes - channel.pinned_bytes,
                                                    caller)
            reads = ReadAhead(len(keys), depth, start, self.done, ready)
            try:
                for i in range(len(keys)):
                    read = await reads.next()
                    if read is None:
                        self.metrics.miss(caller.label)
                        break
                    read.index = i
                    self.metrics.hit(caller.label, read.nbytes)
                    if read.pool_runs is not None and request.pool_views:
                        channel.hold(read.release, read.nbytes)  # pinned until the client's RELEASE
                        read.release = None
                    try:
                        yield read
                    finally:
                        self.done(read)
            finally:
                await reads.close()

    def handover(self, read: Read):
        """What ``read`` holds, to release later; ``read`` itself then holds nothing."""
        held = Read(read.nbytes, release=read.release, pooled=read.pooled)
        read.release = read.pooled = None
        return lambda: self.done(held)
