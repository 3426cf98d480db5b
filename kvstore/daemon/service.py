"""The KVStore gRPC service: validates every request, then runs Store calls in a bounded
executor so the event loop never blocks on file I/O or large copies.

Every user error ends the RPC with a specific status and a message; nothing is stored
unless the whole blob arrived and verified.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import grpc
import numpy as np
import torch
from google.protobuf.message import DecodeError

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.blob import DTYPE_NAMES, HEADER_BYTES, CorruptBlob, verify_blob
from kvstore.codecs import codec_by_id
from kvstore.daemon.buffers import BufferPool
from kvstore.daemon.bulk import BulkError, BulkServer, Channel
from kvstore.daemon.config import DaemonConfig
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.slots import SlotArena, SlotError
from kvstore.wire.convert import keys_from_proto, ns_from_proto, stats_to_proto
from kvstore.wire.frames import CHUNK, DONE, END, ERROR, GET
from kvstore.keys import ChunkKey, Namespace
from kvstore.store import Store, StoreClosed
from tiers.base import TierError, TierFull

SLOT_STATUS = {
    "stale": grpc.StatusCode.FAILED_PRECONDITION,
    "forged": grpc.StatusCode.PERMISSION_DENIED,
    "range": grpc.StatusCode.OUT_OF_RANGE,
    "exhausted": grpc.StatusCode.RESOURCE_EXHAUSTED,
}


class Fail(Exception):
    """End the RPC with ``code`` and this message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# what a handler turns into a status (anything else is a bug and propagates)
_USER_ERRORS = (Fail, SlotError, BulkError, CorruptBlob, TierError, StoreClosed, OSError, ValueError, TypeError)


def _translate(exc: Exception) -> Fail:
    if isinstance(exc, Fail):
        return exc
    if isinstance(exc, SlotError):
        return Fail(SLOT_STATUS[exc.kind], str(exc))
    if isinstance(exc, BulkError):
        return Fail(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    if isinstance(exc, CorruptBlob):
        return Fail(grpc.StatusCode.INVALID_ARGUMENT, f"blob rejected: {type(exc).__name__}: {exc}")
    if isinstance(exc, TierFull):
        return Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    if isinstance(exc, StoreClosed):
        return Fail(grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down")
    if isinstance(exc, (TierError, OSError)):
        return Fail(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    if isinstance(exc, (ValueError, TypeError)):
        return Fail(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
    raise exc


class Malformed:
    """Stands in for a request that did not parse, so the handler can answer INVALID_ARGUMENT
    (grpc's own answer to a deserializer error is a vague UNKNOWN)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _parse(request):
    if isinstance(request, Malformed):
        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"malformed or truncated message: {request.error}")
    return request


def _safe_parser(cls):
    def parse(data: bytes):
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError) as exc:
            return Malformed(exc)

    return parse


def register(service: "KVStoreService", server: grpc.aio.Server) -> None:
    """Add the service to ``server`` with parsers that never raise (see ``Malformed``)."""
    descriptor = pb.DESCRIPTOR.services_by_name["KVStore"]
    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
    }
    handlers = {
        m.name: kinds[(m.client_streaming, m.server_streaming)](
            getattr(service, m.name),
            request_deserializer=_safe_parser(getattr(pb, m.input_type.name)),
            response_serializer=getattr(pb, m.output_type.name).SerializeToString,
        )
        for m in descriptor.methods
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


async def _next(iterator):
    """The next message of a request stream, or None at its end."""
    try:
        return _parse(await iterator.__anext__())
    except StopAsyncIteration:
        return None


def _timed(fn):
    """Latency and error metrics for a unary-response handler; user errors become statuses."""
    name = fn.__name__

    @functools.wraps(fn)
    async def wrapper(self, request, context):
        start = time.perf_counter()
        try:
            return await fn(self, request if fn.__name__ == "Put" else _parse(request), context)
        except _USER_ERRORS as exc:
            fail = _translate(exc)
            self.metrics.rpc_errors.labels(name, fail.code.name).inc()
            await context.abort(fail.code, str(fail))
        finally:
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)

    return wrapper


@dataclass
class _Read:
    """One chunk read for a Get: where its bytes are and what to release once it is sent."""

    nbytes: int
    data: object = None  # bytes to send (a pooled buffer or a blob); None: in its slot or pool_runs
    pool_runs: list[tuple[int, int]] | None = None  # pinned in the host pool, (offset, length)
    release: Callable[[], object] | None = None  # unpins pool_runs
    pooled: np.ndarray | None = None  # give back to the buffer pool
    index: int = 0


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, store: Store, config: DaemonConfig, executor: ThreadPoolExecutor,
                 arena: SlotArena | None, bulk: BulkServer | None, metrics: DaemonMetrics, pool: BufferPool,
                 address: str) -> None:
        self.store, self.config, self.executor, self.pool = store, config, executor, pool
        self.arena, self.bulk, self.metrics, self.address = arena, bulk, metrics, address
        self.limits = config.limits
        self.io_inflight = 0
        # the host pool file same-host clients may map (LeaseReply.pool_path), if shared
        self.pool_path = store.host_pool.path if store.host_pool is not None and arena is not None else None

    async def _run(self, fn, *args, **kwargs):
        """Run a blocking call in the bounded executor; ``io_inflight`` counts queued + running."""
        loop = asyncio.get_running_loop()
        self.io_inflight += 1
        try:
            return await loop.run_in_executor(self.executor, functools.partial(fn, *args, **kwargs))
        finally:
            self.io_inflight -= 1

    # -- request validation ---------------------------------------------------------------

    def _keys(self, request) -> tuple[Namespace, list[ChunkKey]]:
        ns = ns_from_proto(request.namespace)
        hashes = request.prefix_hashes
        if len(hashes) > self.limits.max_keys_per_request:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{len(hashes)} keys in one request; the limit is {self.limits.max_keys_per_request}")
        return ns, keys_from_proto(ns, hashes)

    def _check_size(self, nbytes: int) -> None:
        if nbytes <= HEADER_BYTES:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"blob_bytes {nbytes} is not larger than the {HEADER_BYTES}-byte header")
        if nbytes > self.limits.max_chunk_bytes:
            raise Fail(grpc.StatusCode.RESOURCE_EXHAUSTED,
                       f"chunk of {nbytes} bytes exceeds the limit of {self.limits.max_chunk_bytes}")

    # -- put ------------------------------------------------------------------------------

    def _verify_and_put(self, key: ChunkKey, blob, parent: bytes | None, durable: bool) -> None:
        header, _ = verify_blob(blob, key)
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
        self.store.put_blob(key.id, [blob], parent=parent, durable=durable)

    async def _store(self, h: pb.PutHeader, blob: np.ndarray | None = None, inline=None) -> int:
        """Verify and store the blob a Put names: in ``h.slot``, in ``blob`` (a bulk frame),
        or arriving as the ``inline`` pieces of a Put stream. Returns its size."""
        ns = ns_from_proto(h.namespace)
        key = keys_from_proto(ns, [h.prefix_hash])[0]
        parent = keys_from_proto(ns, [h.parent_hash])[0].id if h.parent_hash else None
        size = h.blob_bytes
        self._check_size(size)
        if h.HasField("slot"):
            if self.arena is None:
                raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is disabled on this daemon")
            with self.arena.using([(h.slot.lease_id, h.slot.index, h.slot.generation)], size) as (view,):
                await self._run(self._verify_and_put, key, view, parent, h.durable)
        elif blob is not None:
            if blob.nbytes != size:
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"bulk frame has {blob.nbytes} bytes, header says {size}")
            await self._run(self._verify_and_put, key, blob, parent, h.durable)
        else:
            buf = self.pool.take(size)
            try:
                await inline(memoryview(buf), size)
                await self._run(self._verify_and_put, key, buf, parent, h.durable)
            finally:
                self.pool.give(buf)
        self.metrics.wrote(ns, size)
        return size

    @_timed
    async def Put(self, request_iterator, context):
        first = await _next(request_iterator)
        if first is None or not first.HasField("header"):
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "a Put stream must start with a header message")
        await self._store(first.header, inline=functools.partial(self._put_inline, first, request_iterator))
        return pb.PutReply()

    @staticmethod
    async def _put_inline(first, request_iterator, view: memoryview, size: int) -> None:
        got = 0
        piece = first.data  # every access copies: read each message's data once
        while True:
            if got + len(piece) > size:
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"Put stream carries more than blob_bytes={size}")
            view[got : got + len(piece)] = piece
            got += len(piece)
            msg = await _next(request_iterator)
            if msg is None:
                break
            if msg.HasField("header"):
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "only the first message of a Put carries a header")
            piece = msg.data
        if got != size:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"Put stream ended after {got} of {size} bytes")

    # -- get ------------------------------------------------------------------------------

    def _read(self, key: ChunkKey, payload: int, slot_view, chunk_bytes: int, pinnable: bool) -> "_Read | None":
        """Read one chunk (in an executor thread): pinned in the host pool if ``pinnable`` and
        it lies there raw; else into ``slot_view``, or into a pooled buffer (TENSOR) or as the
        blob (BLOB). None on a miss."""
        ns = key.namespace
        if pinnable:
            pin = self.store.pinned_payload(key)
            runs = pin.__enter__()
            if runs is not None:
                return _Read(chunk_bytes, pool_runs=runs, release=functools.partial(pin.__exit__, None, None, None))
            pin.__exit__(None, None, None)
        if payload == pb.TENSOR:
            dtype = getattr(torch, ns.dtype)
            if slot_view is not None:
                out = torch.frombuffer(slot_view, dtype=dtype).view(ns.chunk_shape)
                return _Read(chunk_bytes) if self.store.get_into(key, out) else None
            buf = self.pool.take(chunk_bytes)
            if self.store.get_into(key, torch.from_numpy(buf).view(dtype).view(ns.chunk_shape)):
                return _Read(chunk_bytes, data=buf, pooled=buf)
            self.pool.give(buf)
            return None
        blob = self.store.get_blob(key)
        if blob is None:
            return None
        if slot_view is None:
            return _Read(len(blob), data=blob)
        if len(blob) > len(slot_view):
            raise Fail(grpc.StatusCode.OUT_OF_RANGE, f"blob of {len(blob)} bytes does not fit the slot")
        slot_view[: len(blob)] = blob
        return _Read(len(blob))

    async def _read_one(self, key: ChunkKey, payload: int, slot, chunk_bytes: int, pinnable: bool):
        if slot is None:
            return await self._run(self._read, key, payload, None, chunk_bytes, pinnable)
        nbytes = chunk_bytes if payload == pb.TENSOR else self.arena.slot_bytes
        with self.arena.using([(slot.lease_id, slot.index, slot.generation)], nbytes) as (view,):
            return await self._run(self._read, key, payload, view, chunk_bytes, pinnable)

    def _done(self, read: "_Read") -> None:
        if read.release is not None:
            read.release()
        if read.pooled is not None:
            self.pool.give(read.pooled)

    async def _chunks(self, request, held: list | None = None):
        """Validate a GetRequest, then yield one ``_Read`` per chunk, in order, until the first
        miss. ``held`` (bulk channel only) takes the release of chunks pinned in the host pool
        (the client copies them out itself, or the socket sends the pages by reference);
        anything else a chunk holds (pooled buffers) is released when the consumer asks for
        the next one."""
        ns, keys = self._keys(request)
        payload = request.payload
        if payload not in (pb.BLOB, pb.TENSOR):
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"unknown payload kind {payload}")
        chunk_bytes = math.prod(ns.chunk_shape) * torch.finfo(getattr(torch, ns.dtype)).bits // 8
        slots = list(request.slots)
        if slots:
            if self.arena is None:
                raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is disabled on this daemon")
            if len(slots) != len(keys):
                raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"{len(slots)} slots for {len(keys)} keys")
        if request.pool_views and (held is None or not slots):
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "pool_views needs slots and a bulk channel")
        # the socket of a bulk channel sends straight from the pool; a client that maps it copies from it
        pinnable = payload == pb.TENSOR and held is not None and (
            not slots or (request.pool_views and self.pool_path is not None))
        # read ahead: the next chunks are read (in parallel executor threads) while this one travels
        pending: collections.deque = collections.deque()
        queued = 0

        def refill() -> None:
            nonlocal queued
            while queued < len(keys) and len(pending) < self.limits.get_read_ahead:
                pending.append(asyncio.ensure_future(self._read_one(
                    keys[queued], payload, slots[queued] if slots else None, chunk_bytes, pinnable)))
                queued += 1

        refill()
        try:
            for i in range(len(keys)):
                read = await pending.popleft()
                if read is None:
                    self.metrics.miss(ns)
                    return
                read.index = i
                refill()
                self.metrics.hit(ns, read.nbytes)
                if read.pool_runs is not None:  # pinned until the client's RELEASE
                    held.append(read.release)
                    read.release = None
                try:
                    yield read
                finally:
                    self._done(read)
        finally:
            for future in pending:
                try:
                    read = await future  # the executor may be writing into a slot: finish before releasing it
                except Exception:
                    continue
                if read is not None:
                    self._done(read)

    async def Get(self, request, context):
        start = time.perf_counter()
        try:
            request = _parse(request)
            piece = min(request.piece_bytes or self.limits.inline_piece_bytes, self.limits.max_message_bytes - 1024)
            async for read in self._chunks(request):
                if read.data is None:
                    yield pb.GetReply(index=read.index, chunk_bytes=read.nbytes, last=True)
                    continue
                view = memoryview(read.data).cast("B")
                for off in range(0, read.nbytes, piece):
                    yield pb.GetReply(index=read.index, chunk_bytes=read.nbytes if off == 0 else 0,
                                      data=bytes(view[off : off + piece]), last=off + piece >= read.nbytes)
        except _USER_ERRORS as exc:
            fail = _translate(exc)
            self.metrics.rpc_errors.labels("Get", fail.code.name).inc()
            await context.abort(fail.code, str(fail))
        finally:
            self.metrics.rpc_seconds.labels("Get").observe(time.perf_counter() - start)

    # -- the bulk channel -------------------------------------------------------------------

    async def bulk_request(self, channel: Channel, kind: int, meta: bytes, data: np.ndarray | None) -> None:
        """Answer one request of a bulk channel (see kvstore/daemon/bulk.py): the same work
        as the Get and Put RPCs, with replies as frames. Connection errors propagate (the
        channel closes); request errors become an ERROR frame."""
        name = "Get" if kind == GET else "Put"
        start = time.perf_counter()
        try:
            if kind == GET:
                request = _parse(_safe_parser(pb.GetRequest)(meta))
                sent = 0
                async for read in self._chunks(request, channel.held):
                    reply = pb.GetReply(index=read.index, chunk_bytes=read.nbytes, last=True)
                    if read.pool_runs is None:
                        await channel.send(CHUNK, reply.SerializeToString(), read.data)
                    elif request.pool_views:
                        reply.pool_runs.extend(x for run in read.pool_runs for x in run)
                        await channel.send(CHUNK, reply.SerializeToString())
                    elif self.store.host_pool.file is not None:
                        await channel.send_file_ranges(CHUNK, reply.SerializeToString(), self.store.host_pool.file,
                                                       read.pool_runs)
                    else:
                        await channel.send(CHUNK, reply.SerializeToString(), self.store.host_pool.views(read.pool_runs))
                    sent += 1
                await channel.send(END, pb.CountReply(count=sent).SerializeToString())
            else:
                header = _parse(_safe_parser(pb.PutHeader)(meta))
                if header.HasField("slot") and data is not None:
                    raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "a Put names a slot and carries bytes")
                if not header.HasField("slot") and data is None:
                    raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "a Put carries neither bytes nor a slot")
                await self._store(header, blob=data)
                await channel.send(DONE)
        except ConnectionError:
            raise  # the channel broke: nobody to answer
        except _USER_ERRORS as exc:
            fail = _translate(exc)
            self.metrics.rpc_errors.labels(name, fail.code.name).inc()
            await channel.send(ERROR, pb.ErrorReply(code=fail.code.value[0], message=str(fail)).SerializeToString())
        finally:
            if data is not None:
                self.pool.give(data)
            self.metrics.rpc_seconds.labels(name).observe(time.perf_counter() - start)

    # -- index operations -----------------------------------------------------------------

    @_timed
    async def Lookup(self, request, context):
        _, keys = self._keys(request)
        return pb.CountReply(count=await self._run(self.store.lookup, keys))

    @_timed
    async def Contains(self, request, context):
        _, keys = self._keys(request)
        present = await self._run(lambda: [self.store.contains(k) for k in keys])
        return pb.ContainsReply(present=present)

    @_timed
    async def Prefetch(self, request, context):
        _, keys = self._keys(request)
        futures = await self._run(self.store.prefetch, keys)
        if request.wait:
            await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        return pb.CountReply(count=len(futures))

    @_timed
    async def Pin(self, request, context):
        _, keys = self._keys(request)
        if not (math.isfinite(request.ttl_s) and request.ttl_s > 0):
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT, f"ttl_s must be a positive number of seconds, got {request.ttl_s}")
        return pb.CountReply(count=await self._run(self.store.pin, keys, request.ttl_s))

    @_timed
    async def Unpin(self, request, context):
        _, keys = self._keys(request)
        return pb.CountReply(count=await self._run(self.store.unpin, keys))

    @_timed
    async def Delete(self, request, context):
        _, keys = self._keys(request)
        return pb.CountReply(count=await self._run(self.store.delete, keys))

    @_timed
    async def Stats(self, request, context):
        stats = await self._run(self.store.stats)
        return stats_to_proto(stats, address=self.address,
                              shm_slots_free=self.arena.free_slots if self.arena else 0,
                              bulk_sessions=self.bulk.sessions if self.bulk else 0)

    # -- shared memory and bulk sessions ----------------------------------------------------

    def _lease_reply(self, lease) -> pb.LeaseReply:
        a = self.arena
        return pb.LeaseReply(
            lease_id=lease.lease_id, path=a.path, nonce=a.nonce, slot_bytes=a.slot_bytes, ttl_s=a.lease_ttl_s,
            slots=[pb.SlotRef(lease_id=lease.lease_id, index=i, generation=a.generation(i)) for i in lease.slots],
            offsets=[a.offset(i) for i in lease.slots], pool_path=self.pool_path or "",
        )

    def _need_arena(self) -> SlotArena:
        if self.arena is None:
            raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "shared memory is disabled on this daemon")
        return self.arena

    @_timed
    async def Lease(self, request, context):
        return self._lease_reply(self._need_arena().lease(request.slots))

    @_timed
    async def RenewLease(self, request, context):
        return self._lease_reply(self._need_arena().renew(request.lease_id))

    @_timed
    async def ReleaseLease(self, request, context):
        self._need_arena().release(request.lease_id)
        return pb.Empty()

    @_timed
    async def BulkAttach(self, request, context):
        if self.bulk is None:
            raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "the bulk channel is disabled on this daemon")
        session = self.bulk.issue()
        return pb.BulkAttachReply(port=self.bulk.port, session=session.session_id, token=session.token,
                                  max_frame_bytes=self.bulk.max_frame_bytes)
