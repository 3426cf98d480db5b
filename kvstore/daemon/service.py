"""The KVStore gRPC service: who the caller is, what it may touch, then the Store call in a
bounded executor so the event loop never blocks on file I/O or large copies, each piece of
work after its tenant's turn (kvstore/daemon/tenant_work.py).

Every request is bound to the caller's tenant (kvstore/daemon/tenancy.py) and admitted
against its limits (kvstore/daemon/admission.py) before any work; every Store call runs in
the executor and is fenced (kvstore/daemon/reads.py); every error goes through one boundary
(kvstore/daemon/errors.py). A Get's chunks are read by kvstore/daemon/chunk_reads.py, a
Put's stored by kvstore/daemon/chunk_writes.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import operator
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing, contextmanager
from copy import deepcopy

import grpc
import numpy as np

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.config import to_toml
from kvstore.daemon.admission import Admission
from kvstore.daemon.buffers import BufferPool
from kvstore.daemon.bulk import BulkServer
from kvstore.daemon.bulk_channel import Channel
from kvstore.daemon.chunk_reads import ChunkReads, need_arena
from kvstore.daemon.chunk_writes import ChunkWrites
from kvstore.daemon.config import DaemonConfig, io_workers
from kvstore.daemon.errors import Fail, RpcBoundary, parsed, safe_parser
from kvstore.daemon.fair_share import FairShare
from kvstore.daemon.identity import Credentials, Tenant
from kvstore.daemon.key_rate import KeyRate
from kvstore.daemon.metrics import DaemonMetrics
from kvstore.daemon.prefetch import Prefetches
from kvstore.daemon.quotas import Quotas
from kvstore.daemon.read_grants import ReadGrants
from kvstore.daemon.slots import SlotArena
from kvstore.daemon.tenancy import READ, WRITE, Bound, bind
from kvstore.daemon.tenant_scheduler import TenantScheduler
from kvstore.daemon.tenant_work import PIECE_KEYS, TenantWork
from kvstore.keys import ChunkKey
from kvstore.daemon.sessions import SessionBook
from kvstore.api import MIN_PIN_S, pin_ttl, valid_duration
from kvstore.store import Store
from kvstore.wire.auth import METADATA_KEY
from kvstore.wire.convert import stats_to_proto
from kvstore.wire.frames import CHUNK, DONE, END, ERROR, GET
from tiers.url import redact_url

log = logging.getLogger("kvstore.daemon")


class KVStoreService(pb_grpc.KVStoreServicer):
    def __init__(self, store: Store, config: DaemonConfig, executor: ThreadPoolExecutor,
                 arena: SlotArena | None, bulk: BulkServer | None, metrics: DaemonMetrics, pool: BufferPool,
                 credentials: Credentials, quotas: Quotas) -> None:
        self.store, self.config, self.executor, self.pool, self.quotas = store, config, executor, pool, quotas
        self.arena, self.bulk, self.metrics, self.credentials = arena, bulk, metrics, credentials
        self.limits = config.limits
        self.address = ""
        self.work = TenantWork(executor, TenantScheduler(self.limits.scheduler_half_life_s, self.limits.scheduler_idle_s,
                                                         self.limits.scheduler_max_wait_s, metrics))
        self.boundary = RpcBoundary(metrics)
        self.admission = Admission(self.limits.max_requests_per_tenant, self.limits.max_bytes_in_flight_per_tenant,
                                   metrics)
        # KVStore RPCs at once, counted from the moment each opens (the health service is not)
        self.rpcs = FairShare(self.limits.max_concurrent_streams, self.limits.reserved_streams,
                              len(credentials.tenants), metrics, what="RPCs", setting="limits.max_concurrent_streams",
                              reserve="limits.reserved_streams", shed_label="streams")
        # bytes of bulk frames being received or served, all sessions together; a quarter is kept
        # for tenants under their share
        receive = config.bulk.max_receive_bytes
        self.receiving = FairShare(receive, receive // 4, len(credentials.tenants), metrics, what="bytes of bulk frames",
                                   setting="bulk.max_receive_bytes", reserve="a quarter of it",
                                   shed_label="bulk_receive_bytes")
        self.key_rate = KeyRate(self.limits.max_keys_per_s_per_tenant, self.limits.max_keys_per_request, metrics)
        self.prefetches = Prefetches(self.limits.max_prefetches, self.limits.max_prefetches_per_tenant)
        self.sessions = SessionBook(self.limits.max_paused_sessions_per_tenant,
                                    max_groups=self.limits.max_paused_namespaces_per_session,
                                    max_keys=self.limits.max_paused_keys_per_tenant)
        self._certificates = config.tls_client_ca is not None
        # the host pool file same-host clients may map (LeaseReply.pool_path), if shared
        self.pool_path = store.host_pool.path if store.host_pool is not None and arena is not None else None
        self.reads = ChunkReads(store, pool, arena, self.pool_path, self.limits, self.admission,
                                ReadGrants(io_workers(config)), metrics, self.work)
        self.writes = ChunkWrites(store, pool, arena, credentials.shared, self.limits, self.admission, quotas,
                                  metrics, self.work)

    @property
    def io_inflight(self) -> int:
        """Executor calls queued, waiting for their tenant's turn or running."""
        return self.work.inflight

    async def _served(self, caller: Tenant, fn, *args):
        """``fn(*args)`` in the executor within one of ``caller``'s request slots: a tenant's
        flood of small calls (lookups, pins, deletes) is shed at its limit instead of filling
        the executor that every tenant's calls wait for."""
        with self.admission.admit(caller):
            return await self.work.run(caller.label, fn, *args)

    async def _served_in_pieces(self, caller: Tenant, fn, keys: list[ChunkKey], *args, until=None) -> list:
        """``_served`` for ``fn(piece, *args)`` on each piece of ``keys`` (tenant_work.py)."""
        with self.admission.admit(caller):
            return await self.work.in_pieces(caller.label, fn, keys, *args, until=until)

    # -- who is calling, and on what -------------------------------------------------------

    def caller(self, context: grpc.aio.ServicerContext) -> Tenant:
        header = next((v for k, v in context.invocation_metadata() or () if k == METADATA_KEY), None)
        names = (context.auth_context() or {}).get("x509_common_name") if self._certificates else None
        tenant = self.credentials.identify(header, names[0] if names else None, self._certificates)
        if tenant is None:
            raise Fail(grpc.StatusCode.UNAUTHENTICATED, "this credential names no tenant of this daemon")
        return tenant

    def _bind(self, spec: pb.NamespaceSpec, caller: Tenant, access: str) -> Bound:
        return bind(spec, caller, access, self.credentials.shared, self.limits)

    async def _keys(self, request, caller: Tenant, access: str) -> tuple[Bound, list[ChunkKey]]:
        bound = self._bind(request.namespace, caller, access)
        hashes = request.prefix_hashes
        if len(hashes) > self.limits.max_keys_per_request:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"{len(hashes)} keys in one request; the limit is {self.limits.max_keys_per_request}")
        await self.key_rate.take(caller, len(hashes))  # before any per-key work
        keys = []
        for first in range(0, len(hashes), PIECE_KEYS):  # others' requests run in between
            if first:
                await asyncio.sleep(0)
            keys += await self.work.on_loop(caller.label, bound.keys, hashes[first : first + PIECE_KEYS], first)
        if keys:  # what the namespace's chunks occupy is its owner's, read or written
            self.quotas.charge(keys[0], bound.owner)
        return bound, keys

    def _need_arena(self) -> SlotArena:
        return need_arena(self.arena)

    # -- put ------------------------------------------------------------------------------

    async def Put(self, messages, caller: Tenant):
        await self.writes.put_stream(messages, caller)
        return pb.PutReply()

    # -- get ------------------------------------------------------------------------------

    async def Get(self, request, caller: Tenant):
        least = self.limits.min_piece_bytes
        if 0 < request.piece_bytes < least:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"piece_bytes {request.piece_bytes} is below limits.min_piece_bytes = {least}")
        piece = min(request.piece_bytes or self.limits.inline_piece_bytes, self.limits.max_message_bytes - 1024)
        with self.admission.admit(caller):
            bound, keys = await self._keys(request, caller, READ)
            async with aclosing(self.reads.chunks(request, caller, bound, keys)) as chunks:
                async for read in chunks:
                    if read.data is None:
                        yield pb.GetReply(index=read.index, chunk_bytes=read.nbytes, last=True)
                        continue
                    data = read.data if isinstance(read.data, list) else [read.data]
                    view = memoryview(b"".join(data) if len(data) > 1 else data[0]).cast("B")
                    for off in range(0, read.nbytes, piece):
                        yield pb.GetReply(index=read.index, chunk_bytes=read.nbytes if off == 0 else 0,
                                          data=bytes(view[off : off + piece]), last=off + piece >= read.nbytes)

    # -- the bulk channel -------------------------------------------------------------------

    @contextmanager
    def bulk_admit(self, owner: Tenant, meta_bytes: int, data_bytes: int):
        """What a bulk frame announced, held while its request runs: one of its tenant's
        requests and its data bytes of the tenant's in-flight bytes, and meta and data of the
        bytes all bulk sessions receive at once (``bulk.max_receive_bytes``)."""
        with self.admission.admit(owner, data_bytes), self.receiving.hold(owner, meta_bytes + data_bytes):
            yield

    async def charged(self, caller: Tenant, awaitable):
        """``awaitable``, the handling of one of ``caller``'s requests, with the event-loop time
        it takes charged to ``caller`` (kvstore/daemon/tenant_work.py)."""
        return await self.work.charged(caller.label, awaitable)

    async def bulk_request(self, channel: Channel, kind: int, meta: bytes, data: np.ndarray | None,
                           refused: Exception | None) -> None:
        await self.charged(channel.owner, self._bulk_request(channel, kind, meta, data, refused))

    async def _bulk_request(self, channel: Channel, kind: int, meta: bytes, data: np.ndarray | None,
                            refused: Exception | None) -> None:
        """Answer one request of a bulk channel (see kvstore/daemon/bulk.py): the same work
        as the Get and Put RPCs, with replies as frames. Connection errors propagate (the
        channel closes); request errors, and ``refused`` (the frame's admission failed),
        become an ERROR frame."""

        async def answer(fail: Fail) -> None:
            await channel.send(ERROR, pb.ErrorReply(code=fail.code.value[0], message=str(fail)).SerializeToString())

        try:
            async with self.boundary.scope("Get" if kind == GET else "Put", answer, passthrough=(ConnectionError,)):
                if refused is not None:
                    raise refused
                if kind == GET:
                    await self._bulk_get(channel, parsed(safe_parser(pb.GetRequest)(meta)))
                else:
                    header = parsed(safe_parser(pb.PutHeader)(meta))
                    if header.HasField("slot") and data is not None:
                        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "a Put names a slot and carries bytes")
                    if not header.HasField("slot") and data is None:
                        raise Fail(grpc.StatusCode.INVALID_ARGUMENT, "a Put carries neither bytes nor a slot")
                    await self.writes.put(header, channel.owner, blob=data)
                    await channel.send(DONE)
        finally:
            if data is not None:
                self.pool.give(data)

    async def _bulk_get(self, channel: Channel, request: pb.GetRequest) -> None:
        """Replies go to the channel's sender thread; each chunk's pin or buffer is handed over
        with its frame and released once the frame is written (copied into the socket)."""
        sent = 0
        pool = self.store.host_pool
        bound, keys = await self._keys(request, channel.owner, READ)
        async with aclosing(self.reads.chunks(request, channel.owner, bound, keys, channel)) as chunks:
            async for read in chunks:
                reply = pb.GetReply(index=read.index, chunk_bytes=read.nbytes, last=True)
                if request.pool_views and read.pool_runs is not None:
                    reply.pool_runs.extend(x for run in read.pool_runs for x in run)
                    await channel.send(CHUNK, reply.SerializeToString())
                else:
                    data = read.data if read.pool_runs is None else pool.views(read.pool_runs)
                    await channel.send(CHUNK, reply.SerializeToString(), data, then=self.reads.handover(read))
                sent += 1
        await channel.send(END, pb.CountReply(count=sent).SerializeToString())

    # -- index operations -----------------------------------------------------------------

    async def Lookup(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, READ)
        counts = await self._served_in_pieces(caller, self.store.lookup, keys, until=operator.lt)
        return pb.CountReply(count=sum(counts))

    def _contains(self, keys: list[ChunkKey]) -> list[bool]:
        return [self.store.contains(k) for k in keys]

    async def Contains(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, READ)
        present = await self._served_in_pieces(caller, self._contains, keys)
        return pb.ContainsReply(present=[p for piece in present for p in piece])

    def _prefetch(self, keys: list[ChunkKey]) -> list:
        return [next(iter(self.store.prefetch([k])), None) for k in keys]

    def _prefetcher(self, caller: Tenant):
        return functools.partial(self.work.run, caller.label, self._prefetch)

    async def Prefetch(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, READ)
        with self.admission.admit(caller):
            futures = await self.prefetches.start(caller, keys, self._prefetcher(caller))
            if request.wait:  # the promotions kept their owner within its quota (the Store's rule)
                await asyncio.gather(*(asyncio.wrap_future(f) for f in futures), return_exceptions=True)
        return pb.CountReply(count=len(futures))

    async def Pin(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, READ)
        ttl = self._pin_ttl(request.ttl_s)
        return pb.CountReply(count=sum(await self._served_in_pieces(caller, self.store.pin, keys, ttl)))

    async def PinLeading(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, READ)
        ttl = self._pin_ttl(request.ttl_s)
        pinned = await self._served_in_pieces(caller, self.store.pin_leading, keys, ttl, until=operator.lt)
        return pb.CountReply(count=sum(pinned))

    def _pin_ttl(self, ttl: float) -> float:
        if not (math.isfinite(ttl) and 0 < ttl <= self.limits.max_pin_ttl_s):
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"ttl_s must be in (0, {self.limits.max_pin_ttl_s:g}] seconds, got {ttl}")
        return ttl

    # -- agent sessions (advisory: docs/agents.md) --------------------------------------------

    def _session(self, session: str) -> str:
        if not session or len(session.encode()) > self.limits.max_session_id_bytes:
            raise Fail(grpc.StatusCode.INVALID_ARGUMENT,
                       f"session must be 1 to {self.limits.max_session_id_bytes} bytes, got {len(session.encode())}")
        return session

    def _lease(self, seconds: float) -> float:
        return min(seconds, self.limits.max_pin_ttl_s)

    async def Pause(self, request, caller: Tenant):
        """Pin a paused session's chunks for its lease and remember them under its id."""
        _, keys = await self._keys(request, caller, READ)
        session = self._session(request.session)
        ttl, expected = valid_duration(request.ttl_s), valid_duration(request.expected_s)
        lease = self._lease(ttl if ttl else pin_ttl(expected) if expected else MIN_PIN_S)
        if not keys:
            return pb.CountReply(count=0)
        pieces = await self._served_in_pieces(caller, self._pin_present, keys, lease)
        present, pinned = [k for piece, _ in pieces for k in piece], sum(n for _, n in pieces)
        if present:
            self.sessions.pause(caller.name, session, keys[0].namespace, present, lease)
        return pb.CountReply(count=pinned)

    def _pin_present(self, keys: list[ChunkKey], lease: float) -> tuple[list[ChunkKey], int]:
        """Pin ``keys`` for ``lease`` seconds (in an executor thread): the keys that exist, and
        how many were pinned. A pause records only those that exist: before, keys that did not
        were recorded too, and a tenant could fill the daemon's memory with random keys. Each
        key is looked up apart only when some but not all were pinned: a pause of a session's
        chunks pins all, a flood of random keys none."""
        pinned = self.store.pin(keys, lease)
        if pinned == len(keys):
            return keys, pinned
        return ([k for k in keys if self.store.contains(k)] if pinned else []), pinned

    async def ResumeSoon(self, request, caller: Tenant):
        """Bring a paused session's chunks up to host RAM, pinned past its ETA; 0 if unknown."""
        session = self._session(request.session)
        lease = self._lease(pin_ttl(valid_duration(request.eta_s) or 0.0))
        started = 0
        for keys in self.sessions.resume(caller.name, session, lease):
            await self.key_rate.take(caller, len(keys))  # as a request naming them would be
            await self._served_in_pieces(caller, self.store.pin, keys, lease)
            with self.admission.admit(caller):  # the promotions keep each owner within its quota
                futures = await self.prefetches.start(caller, keys, self._prefetcher(caller))
            started += len(futures)
        return pb.CountReply(count=started)

    async def Unpin(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, WRITE)
        return pb.CountReply(count=sum(await self._served_in_pieces(caller, self.store.unpin, keys)))

    async def Delete(self, request, caller: Tenant):
        _, keys = await self._keys(request, caller, WRITE)
        return pb.CountReply(count=sum(await self._served_in_pieces(caller, self.store.delete, keys)))

    async def Stats(self, request, caller: Tenant):
        stats = await self._served(caller, self.store.stats)
        return stats_to_proto(stats, address=self.address,
                              shm_slots_free=self.arena.free_slots if self.arena else 0,
                              bulk_sessions=self.bulk.sessions if self.bulk else 0)

    async def Config(self, request, caller: Tenant):
        """The configuration the daemon runs with: under TLS the bulk channel is off whatever
        the file says (it is not encrypted), and the answer says so."""
        config = redacted(self.config)
        config.bulk.enabled = self.bulk is not None
        return pb.ConfigReply(toml=to_toml(config))

    # -- shared memory and bulk sessions ----------------------------------------------------

    def _lease_reply(self, lease) -> pb.LeaseReply:
        a = self.arena
        return pb.LeaseReply(
            lease_id=lease.lease_id, path=a.path, nonce=a.nonce, slot_bytes=a.slot_bytes, ttl_s=a.lease_ttl_s,
            slots=[pb.SlotRef(lease_id=lease.lease_id, index=i, generation=a.generation(i)) for i in lease.slots],
            offsets=[a.offset(i) for i in lease.slots], pool_path=self.pool_path or "",
        )

    async def Lease(self, request, caller: Tenant):
        return self._lease_reply(self._need_arena().lease(request.slots, caller.name, request.request_id))

    async def RenewLease(self, request, caller: Tenant):
        return self._lease_reply(self._need_arena().renew(request.lease_id, caller.name))

    async def ReleaseLease(self, request, caller: Tenant):
        if request.request_id:
            self._need_arena().release_request(request.request_id, caller.name)
        else:
            self._need_arena().release(request.lease_id, caller.name)
        return pb.Empty()

    async def BulkAttach(self, request, caller: Tenant):
        if self.bulk is None:
            raise Fail(grpc.StatusCode.FAILED_PRECONDITION, "the bulk channel is disabled on this daemon")
        session = self.bulk.issue(caller)
        return pb.BulkAttachReply(port=self.bulk.port, session=session.session_id, token=session.token,
                                  max_frame_bytes=self.bulk.max_frame_bytes, pin_ttl_s=self.bulk.config.pin_ttl_s,
                                  max_pinned_bytes=self.bulk.config.max_pinned_bytes)


def redacted(config):
    """A copy of a config tree whose URLs carry no password: what the Config RPC answers
    (any authenticated tenant may ask, and a tier's password would open every tenant's chunks)."""
    config = deepcopy(config)
    stack = [config]
    while stack:
        obj = stack.pop()
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                stack.append(value)
            elif isinstance(value, str) and (f.name == "url" or f.name.endswith("_url")):
                setattr(obj, f.name, redact_url(value))
    return config


def register(service: KVStoreService, server: grpc.aio.Server) -> None:
    """Add the service to ``server``: parsers that never raise, and every handler inside the
    one boundary, with the caller identified and its messages parsed before the body runs."""
    descriptor = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers = {}
    for m in descriptor.methods:
        body = getattr(service, m.name)
        parser = safe_parser(getattr(pb, m.input_type.name))
        serializer = getattr(pb, m.output_type.name).SerializeToString
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _streaming(service, m.name, body), request_deserializer=parser, response_serializer=serializer)
        elif m.client_streaming:
            handlers[m.name] = grpc.stream_unary_rpc_method_handler(
                _unary(service, m.name, body, stream=True), request_deserializer=parser, response_serializer=serializer)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(service, m.name, body, stream=False), request_deserializer=parser, response_serializer=serializer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(descriptor.full_name, handlers),))


def _aborter(context):
    async def answer(fail: Fail) -> None:
        await context.abort(fail.code, str(fail))

    return answer


async def _messages(request_iterator):
    async for message in request_iterator:
        yield parsed(message)


def _unary(service: KVStoreService, name: str, body, stream: bool):
    async def handle(request, context):
        async with service.boundary.scope(name, _aborter(context)):
            caller = service.caller(context)
            with service.rpcs.hold(caller):
                return await service.charged(caller, body(_messages(request) if stream else parsed(request), caller))

    return handle


def _streaming(service: KVStoreService, name: str, body):
    async def handle(request, context):
        async with service.boundary.scope(name, _aborter(context)):
            caller = service.caller(context)
            with service.rpcs.hold(caller):
                async with aclosing(body(parsed(request), caller)) as replies:
                    while True:
                        try:
                            reply = await service.charged(caller, anext(replies))
                        except StopAsyncIteration:
                            break
                        yield reply

    return handle
