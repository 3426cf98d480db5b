"""The chunks a Put stores, arriving in a client's slot, a bulk frame or a Put stream.

A blob's header is verified against the namespace it is put in, and its owner's quota made
room for, before the Store sees it; the Store checks the payload against the header as it
copies it into host RAM (``Store.put_claimed``): nothing is stored unless the whole blob
arrived and verified. A blob in a client's slot is stored straight from there (what is
checked is the copy, whatever the client writes meanwhile). Each copy and verification runs
in an executor thread as a piece of its tenant's work (tenant_work.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools

import grpc
import numpy as np

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.blob import DTYPE_NAMES, HEADER_BYTES, verify_blob_header
from kvstore.codecs import codec_by_id
from kvstore.daemon.admission import Admission
from kvstore.daemon.buffers import BufferPool
from kvstore.daemon.chunk_reads import need_arena
from kvstore.daemon.config import LimitsConfig
from kvstore.daemon.errors import Fail
from kvstore.daemon.identity import Tenant
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.quotas import Quotas
from kvstore.daemon.slots import SlotArena
from kvstore.daemon.tenancy import WRITE, Bound, bind
from kvstore.daemon.tenant_work import TenantWork
from kvstore.keys import ChunkKey
from kvstore.store import Store


class ChunkWrites:
    def __init__(self, store: Store, pool: BufferPool, arena: SlotArena | None, shared: Tenant | None,
                 limits: LimitsConfig, admission: Admission, quotas: Quotas, metrics: DaemonMetrics,
                 work: TenantWork) -> None:
        self.store, self.pool, self.arena, self.shared, self.limits = store, pool, arena, shared, limits
        self.admission, self.quotas, self.metrics, self.work = admission, quotas, metrics, work

    def _check_size(self, nbytes: int) -> None:
        if nbytes <= HEADER_BYTES:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"blob_bytes {nbytes} is not larger than the {HEADER_BYTES}-byte header")
        if nbytes > self.limits.max_chunk_bytes:
            raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"chunk of {nbytes} bytes exceeds the limit of {self.limits.max_chunk_bytes}")

    def _verify_and_put(self, bound: Bound, key: ChunkKey, blob, parent: bytes | None, durable: bool) -> None:
        """Verify ``blob``'s header (a copy of it: ``blob`` may be a slot its client still
        writes) against the namespace, and put it; the Store checks the payload against the
        header as it copies it into host RAM (``Store.put_claimed``)."""
        view = memoryview(blob).cast("B")
        head = bytes(view[:HEADER_BYTES])
        header = verify_blob_header(head, view.nbytes, ChunkKey(bound.claimed, key.prefix_hash))
        try:
            codec_by_id(header.codec_id)
        except KeyError:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"blob uses codec id {header.codec_id}, "
                       "which this daemon does not know") from None
        ns = key.namespace
        if DTYPE_NAMES[header.dtype] != ns.dtype or header.shape != ns.chunk_shape:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"blob holds {DTYPE_NAMES[header.dtype]}{list(header.shape)}, the namespace needs "
                       f"{ns.dtype}{list(ns.chunk_shape)}")
        payload = view[HEADER_BYTES:]
        if bound.rekeyed:
            head = bound.header_for(header, payload, claimed=False)
            header = dataclasses.replace(header, namespace_fp=bound.ns.fingerprint)
        self.quotas.charge(key, bound.owner)  # the Store keeps the owner within its quotas
        self.store.put_claimed(key, head, header, payload, parent=parent, durable=durable)

    async def put(self, h: pb.PutHeader, caller: Tenant, blob: np.ndarray | None = None, inline=None) -> None:
        """Verify and store the blob a Put names: in ``h.slot``, in ``blob`` (a bulk frame,
        whose bytes the bulk server admitted when the frame announced them), or arriving as
        the ``inline`` pieces of a Put stream. The caller holds one of ``caller``'s requests."""
        bound = bind(h.namespace, caller, WRITE, self.shared, self.limits)
        key = bound.keys([h.prefix_hash])[0]
        parent = bound.keys([h.parent_hash])[0].id if h.parent_hash else None
        size = h.blob_bytes
        self._check_size(size)
        if blob is not None:
            if blob.nbytes != size:
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"bulk frame has {blob.nbytes} bytes, header says {size}")
            await self.work.run(caller.label, self._verify_and_put, bound, key, blob, parent, h.durable)
        else:
            with self.admission.add_bytes(caller, size):
                if h.HasField("slot"):  # stored straight from the slot; what is checked is the copy
                    ref = (h.slot.lease_id, h.slot.index, h.slot.generation)
                    with need_arena(self.arena).using([ref], size, caller.name) as (view,):
                        await self.work.run(caller.label, self._verify_and_put, bound, key, view, parent, h.durable)
                else:
                    buf = self.pool.take(size)
                    try:
                        await inline(memoryview(buf), size)
                        await self.work.run(caller.label, self._verify_and_put, bound, key, buf, parent, h.durable)
                    finally:
                        self.pool.give(buf)
        self.metrics.wrote(caller.label, size)

    async def put_stream(self, messages, caller: Tenant) -> None:
        """Store the blob of a Put stream. The stream is one of its tenant's requests from the
        moment it opens, and each of its messages, the first included, must come within
        ``stream_idle_timeout_s``: before, a stream that sent nothing held a place of the
        daemon-wide RPC limit, uncounted."""
        with self.admission.admit(caller):
            first = await self._next(messages)
            if first is None or not first.HasField("header"):
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "a Put stream must start with a header message")
            await self.put(first.header, caller, inline=functools.partial(self._put_inline, first, messages))

    async def _next(self, messages):
        """The next message of a Put stream (None at its end), within ``stream_idle_timeout_s``."""
        limit = self.limits.stream_idle_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await anext(messages, None)
        except TimeoutError:
            raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the Put stream sent nothing for {limit:g} s "
                       f"(limits.stream_idle_timeout_s = {limit:g})") from None

    async def _put_inline(self, first, messages, view: memoryview, size: int) -> None:
        got = 0
        piece = first.data  # every access copies: read each message's data once
        while True:
            if got + len(piece) > size:
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"Put stream carries more than blob_bytes={size}")
            view[got : got + len(piece)] = piece
            got += len(piece)
            msg = await self._next(messages)
            if msg is None:
                break
            if msg.HasField("header"):
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "only the first message of a Put carries a header")
            piece = msg.data
            if len(piece) < self.limits.min_piece_bytes and got + len(piece) < size:  # only the last may be small
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"a Put piece of {len(piece)} bytes that is not the "
                           f"last; pieces are at least limits.min_piece_bytes = {self.limits.min_piece_bytes}")
        if got != size:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"Put stream ended after {got} of {size} bytes")
