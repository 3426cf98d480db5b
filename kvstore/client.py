"""Clients of the kvstore daemon with the Store's methods, so callers (the connector) can use
an in-process Store or a daemon interchangeably.

Chunk bytes take the fastest path available, chosen once per client:

- ``shm``: the daemon runs on this host (we can map its slot arena and read its nonce):
  a put's blob is copied into a leased shared-memory slot, only the slot reference travels;
  a get copies raw chunks straight out of the daemon's host pool (mapped read-only), others
  out of slots;
- ``bulk``: chunk bytes on a plain TCP connection authenticated by a one-time token from an RPC;
- ``grpc``: bytes pieces inside gRPC messages (works everywhere, TLS included).

Gets and puts go over a bulk channel whenever the daemon offers one (shm included: gRPC costs
about as much per message as moving a 4 MiB chunk), else over gRPC.
``transport="auto"`` picks shm, else bulk, else grpc; ``"shm"`` or ``"remote"`` (bulk, else
grpc) or ``"grpc"`` (no bulk channel either) force one. Calls fail with ``DaemonError`` (the gRPC status code and
message); only UNAVAILABLE is retried, with exponential backoff, because every operation
is idempotent. One channel, one lease and a pool of bulk connections are reused across calls;
``Client`` is thread-safe; ``AsyncClient`` is its asyncio twin (grpc.aio, event-loop sockets).

Differences from Store: ``put_blob`` takes a ChunkKey (the wire names the namespace in full),
or a key id of a namespace this client has seen; ``prefetch`` returns completed futures once
the daemon has started the promotions; ``flush``/``close`` only concern this connection.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import queue
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import grpc
import numpy as np
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore._proto import kvstore_pb2 as pb
from kvstore._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.blob import encode_header, verify_blob
from kvstore.codecs import get_codec
from kvstore.codecs.raw import tensor_bytes
from kvstore.malloc import keep_large_blocks_in_heap
from kvstore.wire.auth import bearer, read_token_file
from kvstore.wire.frames import CHUNK, DONE, END, ERROR, FRAME, GET, HELLO, NONCE_BYTES, PUT, RELEASE
from kvstore.wire.convert import ns_to_proto, split_host_port, stats_from_proto
from kvstore.keys import HASH_BYTES, ChunkKey, Namespace
from kvstore.stats import StoreStats

TRANSPORTS = ("auto", "shm", "remote", "grpc")
MAX_MESSAGE_BYTES = 64 << 20


class DaemonError(Exception):
    """An RPC failed; ``code`` is the gRPC status code."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class _Shm:
    """This client's lease on the daemon's slot arena and the slots it may use."""

    def __init__(self, reply: pb.LeaseReply) -> None:
        fd = os.open(reply.path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if self._mmap[:NONCE_BYTES] != reply.nonce:
            self._mmap.close()
            raise OSError(f"{reply.path} is not the daemon's arena (nonce differs)")
        self.pool = None  # the daemon's host pool, read-only, when it shares it
        if reply.pool_path:
            fd = os.open(reply.pool_path, os.O_RDONLY)
            try:
                self.pool = memoryview(mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
            finally:
                os.close(fd)
        self.lease_id = reply.lease_id
        self.slot_bytes = reply.slot_bytes
        self.ttl_s = reply.ttl_s
        self.last_use = time.monotonic()
        view = memoryview(self._mmap)
        self.free: queue.Queue = queue.Queue()
        self.count = len(reply.slots)
        for ref, offset in zip(reply.slots, reply.offsets):
            self.free.put((ref, view[offset : offset + reply.slot_bytes]))

    def take(self, want: int) -> list:
        """At least one slot (blocking), up to ``want`` if free now."""
        slots = [self.free.get()]
        while len(slots) < want:
            try:
                slots.append(self.free.get_nowait())
            except queue.Empty:
                break
        return slots

    def give(self, slots) -> None:
        for s in slots:
            self.free.put(s)


class _BulkSession:
    """One attached bulk connection (kvstore/daemon/bulk.py); one request at a time."""

    def __init__(self, host: str, reply: pb.BulkAttachReply, timeout_s: float, buffer_bytes: int = 4 << 20) -> None:
        self.sock = socket.create_connection((host, reply.port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        self.max_frame_bytes = reply.max_frame_bytes
        self.sock.sendall(HELLO.pack(reply.session, reply.token))
        if self.sock.recv(1) != b"\x01":
            self.sock.close()
            raise ConnectionError("the daemon refused the bulk connection")

    def send(self, kind: int, meta: bytes, views: Sequence[memoryview] = ()) -> None:
        self.sock.sendall(FRAME.pack(kind, len(meta), sum(v.nbytes for v in views)) + meta)
        for v in views:
            self.sock.sendall(v)

    def _recv_exactly(self, view: memoryview) -> None:
        got = 0
        while got < view.nbytes:
            n = self.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the daemon closed the bulk connection")
            got += n

    def reply(self) -> tuple[int, bytes, int]:
        """The next reply frame's kind, meta and data length (read the data with ``recv_into``);
        an ERROR frame raises its DaemonError."""
        header = bytearray(FRAME.size)
        self._recv_exactly(memoryview(header))
        kind, meta_len, data_len = FRAME.unpack(header)
        meta = bytearray(meta_len)
        self._recv_exactly(memoryview(meta))
        return _checked_reply(kind, bytes(meta), data_len)

    def recv_into(self, view: memoryview) -> None:
        self._recv_exactly(view)

    def replies(self, request: pb.GetRequest):
        """Send a Get; yield ``(GetReply, data_len)`` per chunk (read the data before the next).
        Once all arrived, RELEASE unpins what the daemon held for us."""
        self.send(GET, request.SerializeToString())
        while True:
            kind, meta, data_len = self.reply()
            if kind == END:
                self.send(RELEASE, b"")
                return
            yield _chunk_reply(kind, meta), data_len

    def put(self, header: pb.PutHeader, views: Sequence[memoryview]) -> None:
        self.send(PUT, header.SerializeToString(), views)
        kind, _, _ = self.reply()
        if kind != DONE:
            raise ConnectionError(f"bulk frame of kind {kind} where DONE was expected")

    def close(self) -> None:
        self.sock.close()


_STATUS = {code.value[0]: code for code in grpc.StatusCode}


def _checked_reply(kind: int, meta: bytes, data_len: int) -> tuple[int, bytes, int]:
    if kind == ERROR:
        error = pb.ErrorReply.FromString(meta)
        raise DaemonError(_STATUS.get(error.code, grpc.StatusCode.UNKNOWN), error.message)
    if kind not in (CHUNK, END, DONE):
        raise ConnectionError(f"unknown bulk frame kind {kind}")
    return kind, meta, data_len


def _chunk_reply(kind: int, meta: bytes) -> pb.GetReply:
    if kind != CHUNK:
        raise ConnectionError(f"bulk frame of kind {kind} inside a Get")
    return pb.GetReply.FromString(meta)


class _ClientBase:
    """What both clients share: options, credentials, and turning calls into requests."""

    def __init__(self, addr: str, token: str | None, token_file: str | None, tls_ca: str | None,
                 timeout_s: float, retries: int, backoff_s: float, transport: str, shm_slots: int,
                 piece_bytes: int, tune_malloc: bool) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.addr = addr
        self.host, _ = split_host_port(addr)
        if tune_malloc:
            keep_large_blocks_in_heap()
        if token_file:
            token = read_token_file(token_file)
        self._metadata = (bearer(token),) if token else ()
        self._options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                         ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self._root_certs = None
        if tls_ca:
            with open(tls_ca, "rb") as f:
                self._root_certs = f.read()
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.transport = transport
        self.shm_slots, self.piece_bytes = shm_slots, piece_bytes
        self._bulk_ok = not tls_ca
        self._namespaces: dict[bytes, Namespace] = {}

    def _channel_for(self, module):
        """A channel of ``grpc`` or ``grpc.aio`` with this client's options and credentials."""
        if self._root_certs is not None:
            creds = grpc.ssl_channel_credentials(root_certificates=self._root_certs)
            return module.secure_channel(self.addr, creds, options=self._options)
        return module.insecure_channel(self.addr, options=self._options)

    def _ns(self, spec: Namespace) -> pb.NamespaceSpec:
        self._namespaces.setdefault(spec.fingerprint, spec)
        return ns_to_proto(spec)

    @staticmethod
    def _one_ns(keys: Sequence[ChunkKey]) -> Namespace | None:
        if not keys:
            return None
        ns = keys[0].namespace
        if any(k.namespace != ns for k in keys):
            raise ValueError("all keys of one call must share a namespace")
        return ns

    def _keys_request(self, cls, keys: Sequence[ChunkKey], **kw):
        ns = self._one_ns(keys)
        return cls(namespace=self._ns(ns), prefix_hashes=[k.prefix_hash for k in keys], **kw)

    @staticmethod
    def _check(ns: Namespace, tensor: torch.Tensor, what: str) -> None:
        if tuple(tensor.shape) != ns.chunk_shape or str(tensor.dtype).removeprefix("torch.") != ns.dtype:
            raise ValueError(f"{what} {tensor.dtype}{list(tensor.shape)} does not match namespace "
                             f"{ns.dtype}{list(ns.chunk_shape)}")

    def _encode(self, key: ChunkKey, kv: torch.Tensor, codec: str | None) -> list:
        """The blob of a chunk in two parts: header, payload view."""
        self._check(key.namespace, kv, "chunk")
        chosen = get_codec(codec or "raw")
        kv = kv.detach().to("cpu").contiguous()
        payload = chosen.encode(kv)
        return [encode_header(key, chosen.codec_id, kv.dtype, kv.shape, payload), payload]

    def _key_of(self, key: ChunkKey | bytes) -> ChunkKey:
        if isinstance(key, ChunkKey):
            return key
        ns = self._namespaces.get(bytes(key[:HASH_BYTES]))
        if ns is None or len(key) != 2 * HASH_BYTES:
            raise ValueError("put_blob needs a ChunkKey, or the id of a key whose namespace this client has used")
        return ChunkKey(ns, bytes(key[HASH_BYTES:]))

    def _put_header(self, key, parts, parent, durable) -> tuple[pb.PutHeader, list[memoryview], int]:
        key = self._key_of(key)
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        parent_hash = b""
        if parent is not None:
            parent_hash = parent.prefix_hash if isinstance(parent, ChunkKey) else bytes(parent[HASH_BYTES:])
        header = pb.PutHeader(namespace=self._ns(key.namespace), prefix_hash=key.prefix_hash,
                              parent_hash=parent_hash, durable=durable, blob_bytes=size)
        return header, views, size

    def _pieces(self, header: pb.PutHeader, views):
        yield pb.PutRequest(header=header)
        for v in views:
            for off in range(0, v.nbytes, self.piece_bytes):
                yield pb.PutRequest(data=bytes(v[off : off + self.piece_bytes]))

    @staticmethod
    def _stale(exc: DaemonError) -> bool:
        """A lease or bulk session the daemon no longer knows (lapsed, or it restarted)."""
        return exc.code == grpc.StatusCode.FAILED_PRECONDITION and ("lease" in str(exc) or "bulk session" in str(exc))

    @staticmethod
    def _lease_ok(shm: "_Shm") -> bool:
        """Whether a lease was used recently enough to skip renewing it before use."""
        return time.monotonic() - shm.last_use <= shm.ttl_s / 2


class Client(_ClientBase):
    def __init__(
        self,
        addr: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 4,
        backoff_s: float = 0.05,
        transport: str = "auto",
        shm_slots: int = 8,
        piece_bytes: int = 4 << 20,
        tune_malloc: bool = True,
    ) -> None:
        """``tune_malloc`` keeps chunk-sized blocks in this process's heap (see
        ``kvstore.malloc``): without it every chunk buffer ``get`` allocates faults in
        all its pages, which costs more than receiving the chunk."""
        super().__init__(addr, token, token_file, tls_ca, timeout_s, retries, backoff_s, transport,
                         shm_slots, piece_bytes, tune_malloc)
        self._channel = self._channel_for(grpc)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._lock = threading.Lock()
        self._shm: _Shm | None = None
        self._shm_tried = False
        self._bulk_idle: list[_BulkSession] = []

    # -- plumbing -------------------------------------------------------------------------

    def _rpc(self, method, request, **kw):
        try:
            return method(request, timeout=self.timeout_s, metadata=self._metadata, **kw)
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None

    def _retrying(self, op):
        """Run ``op()`` again after UNAVAILABLE (backoff), resetting transports in between.

        A lease or bulk session the daemon no longer knows (it restarted, or the lease lapsed)
        is replaced once, without backoff."""
        delay = self.backoff_s
        renewed = False
        attempt = 0
        while True:
            try:
                return op()
            except DaemonError as exc:
                if self._stale(exc) and not renewed:
                    renewed = True
                    self._drop_shm()
                    self._drop_bulk()
                    continue
                if exc.code != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    raise
            except (ConnectionError, OSError, socket.timeout) as exc:
                self._drop_bulk()
                if attempt == self.retries:
                    raise DaemonError(grpc.StatusCode.UNAVAILABLE, f"bulk channel: {exc}") from None
            self._drop_shm()
            self._drop_bulk()
            time.sleep(delay)
            delay *= 2
            attempt += 1

    # -- transports -----------------------------------------------------------------------

    def _shm_or_none(self) -> _Shm | None:
        if self.transport in ("remote", "grpc"):
            return None
        with self._lock:
            if self._shm is not None:
                if not self._lease_ok(self._shm):
                    self._rpc(self._stub.RenewLease, pb.LeaseRef(lease_id=self._shm.lease_id))
                self._shm.last_use = time.monotonic()
                return self._shm
            if self._shm_tried and self.transport == "auto":
                return None
            self._shm_tried = True
            try:
                reply = self._rpc(self._stub.Lease, pb.LeaseRequest(slots=self.shm_slots))
            except DaemonError:
                if self.transport == "shm":
                    raise
                return None
            try:
                self._shm = _Shm(reply)
            except OSError as exc:
                self._rpc(self._stub.ReleaseLease, pb.LeaseRef(lease_id=reply.lease_id))
                if self.transport == "shm":
                    raise DaemonError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"shared memory is not reachable from this host: {exc}") from None
                return None
            return self._shm

    def _drop_shm(self) -> None:
        with self._lock:
            self._shm, self._shm_tried = None, False

    def _bulk_take(self) -> _BulkSession | None:
        if self.transport == "grpc" or not self._bulk_ok:
            return None
        with self._lock:
            if self._bulk_idle:
                return self._bulk_idle.pop()
        try:
            reply = self._rpc(self._stub.BulkAttach, pb.BulkAttachRequest())
        except DaemonError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                self._bulk_ok = False  # the daemon has no bulk channel: use gRPC
                return None
            raise
        return _BulkSession(self.host, reply, self.timeout_s)

    def _bulk_give(self, session: _BulkSession) -> None:
        with self._lock:
            self._bulk_idle.append(session)

    def _drop_bulk(self) -> None:
        with self._lock:
            idle, self._bulk_idle = self._bulk_idle, []
        for s in idle:
            s.close()

    @property
    def path(self) -> str:
        """The transport chunk bytes take now: "shm", "bulk" or "grpc"."""
        if self._shm_or_none() is not None:
            return "shm"
        session = self._bulk_take()
        if session is None:
            return "grpc"
        self._bulk_give(session)
        return "bulk"

    # -- put ------------------------------------------------------------------------------

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None,
            durable: bool = False, codec: str | None = None) -> None:
        """Store one chunk (encoded here, verified by the daemon)."""
        self.put_blob(key, self._encode(key, kv, codec), parent=parent, durable=durable)

    def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: ChunkKey | bytes | None = None,
                 durable: bool = False) -> None:
        """Store an encoded blob (header + payload, possibly in pieces)."""
        header, views, size = self._put_header(key, parts, parent, durable)
        self._retrying(lambda: self._put(header, views, size))

    def _put(self, header: pb.PutHeader, views, size: int) -> None:
        shm = self._shm_or_none()
        session = self._bulk_take()
        try:
            if shm is not None and size <= shm.slot_bytes:
                (slot,) = shm.take(1)
                try:
                    ref, view = slot
                    _copy_parts(view, views)
                    header.slot.CopyFrom(ref)
                    self._put_request(header, [], session)
                finally:
                    shm.give([slot])
            elif session is not None and size <= session.max_frame_bytes:
                self._put_request(header, views, session)
            else:
                self._rpc(self._stub.Put, self._pieces(header, views))
        except BaseException:
            if session is not None:
                session.close()  # its state is unknown: the next call attaches a fresh one
            raise
        if session is not None:
            self._bulk_give(session)

    def _put_request(self, header: pb.PutHeader, views, session: _BulkSession | None) -> None:
        """A Put whose blob is in a slot (no ``views``) or in ``views``, on the bulk channel or gRPC."""
        if session is not None:
            session.put(header, views)
        else:
            self._rpc(self._stub.Put, iter([pb.PutRequest(header=header)]))

    # -- get ------------------------------------------------------------------------------

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Load a chunk into ``out`` (contiguous CPU tensor of the chunk's shape); False on a miss."""
        self._check(key.namespace, out, "out")
        return self._retrying(lambda: self._get([key], pb.TENSOR, [tensor_bytes(out)])) == 1

    def get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading chunks of ``keys`` that are present, in order (stops at the first miss)."""
        ns = self._one_ns(keys)
        if ns is None:
            return []
        outs = [torch.empty(ns.chunk_shape, dtype=getattr(torch, ns.dtype)) for _ in keys]
        return outs[: self.get_many_into(keys, outs)]

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        """Load the leading present chunks into ``outs`` (reused buffers); returns how many."""
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} buffers for {len(keys)} keys")
        for k, o in zip(keys, outs):
            self._check(k.namespace, o, "out")
        if not keys:
            return 0
        return self._retrying(lambda: self._get(list(keys), pb.TENSOR, [tensor_bytes(o) for o in outs]))

    def get_blob(self, key: ChunkKey) -> bytes | None:
        """The verified blob (header + encoded payload) of a chunk, or None on a miss."""
        blobs: list = [None]
        if self._retrying(lambda: self._get([key], pb.BLOB, blobs)) == 0:
            return None
        blob = bytes(blobs[0])
        verify_blob(blob, key, check_payload=False)  # the daemon checked the payload
        return blob

    def _get(self, keys: list[ChunkKey], payload: int, outs: list) -> int:
        """Fill ``outs`` (views to fill, or None entries replaced by buffers); returns hits."""
        shm = self._shm_or_none()
        session = self._bulk_take()
        try:
            if shm is not None and (payload == pb.BLOB or outs[0].nbytes <= shm.slot_bytes):
                got = 0
                while got < len(keys):
                    slots = shm.take(len(keys) - got)
                    try:
                        n = self._get_slots(keys[got : got + len(slots)], payload, outs, got, slots, session,
                                            shm.pool)
                    finally:
                        shm.give(slots)
                    got += n
                    if n < len(slots):
                        break
            else:
                got = self._get_stream(keys, payload, outs, session)
        except BaseException:
            if session is not None:
                session.close()
            raise
        if session is not None:
            self._bulk_give(session)
        return got

    def _replies(self, request: pb.GetRequest, session: _BulkSession | None):
        """``(GetReply, data_len)`` per reply: on the bulk channel (read a chunk's ``data_len``
        bytes from the session before the next), else from the gRPC stream (data inline)."""
        if session is not None:
            yield from session.replies(request)
            return
        call = self._stub.Get(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            for reply in call:
                yield reply, 0
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None
        finally:
            call.cancel()  # no-op once the stream ended; stops it when the caller gives up

    def _get_slots(self, keys, payload, outs, base: int, slots, session, pool) -> int:
        """Chunks placed in ``slots``, or (``pool`` mapped, bulk channel) read straight out of
        the daemon's host pool, pinned there until the session sends RELEASE."""
        pool_views = pool is not None and session is not None and payload == pb.TENSOR
        request = self._keys_request(pb.GetRequest, keys, payload=payload, slots=[ref for ref, _ in slots],
                                     pool_views=pool_views)
        got = 0
        for reply, _ in self._replies(request, session):
            i = base + reply.index
            if outs[i] is None:
                outs[i] = bytes(slots[reply.index][1][: reply.chunk_bytes])
            else:
                _check_size(outs[i], reply.chunk_bytes)
                _copy_out(outs[i], reply, slots[reply.index][1], pool)
            got += 1
        return got

    def _get_stream(self, keys, payload, outs, session: _BulkSession | None) -> int:
        request = self._keys_request(pb.GetRequest, keys, payload=payload, piece_bytes=self.piece_bytes)
        sink = _StreamSink(outs)
        for reply, data_len in self._replies(request, session):
            view = sink.take(reply, data_len, bulk=session is not None)
            if view is not None:
                session.recv_into(view)
            sink.done(reply)
        return sink.got

    # -- index operations -----------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        request = self._keys_request(pb.KeysRequest, keys)
        return self._retrying(lambda: self._rpc(self._stub.Lookup, request)).count

    def contains(self, key: ChunkKey) -> bool:
        request = self._keys_request(pb.KeysRequest, [key])
        return self._retrying(lambda: self._rpc(self._stub.Contains, request)).present[0]

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        if not keys:
            return 0
        request = self._keys_request(pb.PinRequest, keys, ttl_s=ttl_s)
        return self._retrying(lambda: self._rpc(self._stub.Pin, request)).count

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        request = self._keys_request(pb.KeysRequest, keys)
        return self._retrying(lambda: self._rpc(self._stub.Unpin, request)).count

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = False) -> list[Future]:
        """Ask the daemon to promote chunks held only in slower tiers; one completed future per
        promotion started (with ``wait`` once they are done)."""
        if not keys:
            return []
        request = self._keys_request(pb.PrefetchRequest, keys, wait=wait)
        count = self._retrying(lambda: self._rpc(self._stub.Prefetch, request)).count
        futures = [Future() for _ in range(count)]
        for f in futures:
            f.set_result(None)
        return futures

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        if not keys:
            return 0
        request = self._keys_request(pb.KeysRequest, keys)
        return self._retrying(lambda: self._rpc(self._stub.Delete, request)).count

    def stats(self) -> StoreStats:
        return stats_from_proto(self.stats_reply())

    def stats_reply(self) -> pb.StatsReply:
        """The daemon's full stats message (Store stats plus address, free slots, sessions)."""
        return self._retrying(lambda: self._rpc(self._stub.Stats, pb.StatsRequest()))

    def ping(self) -> tuple[str, float]:
        """The daemon's health status name and the round-trip time in seconds."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        start = time.perf_counter()
        reply = self._retrying(lambda: self._rpc(stub.Check, health_pb2.HealthCheckRequest()))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), time.perf_counter() - start

    def flush(self) -> None:
        """Nothing is buffered client-side: every acknowledged put is in the daemon."""

    def close(self) -> None:
        with self._lock:
            shm, self._shm = self._shm, None
        if shm is not None:
            try:
                self._rpc(self._stub.ReleaseLease, pb.LeaseRef(lease_id=shm.lease_id))
            except DaemonError:
                pass  # the daemon reclaims it when the lease expires
        self._drop_bulk()
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _AsyncBulkSession:
    """``_BulkSession`` driven by the event loop (non-blocking socket); one request at a time."""

    def __init__(self, sock: socket.socket, reply: pb.BulkAttachReply) -> None:
        self.sock, self.max_frame_bytes = sock, reply.max_frame_bytes

    @classmethod
    async def open(cls, host: str, reply: pb.BulkAttachReply, buffer_bytes: int = 4 << 20) -> "_AsyncBulkSession":
        loop = asyncio.get_running_loop()
        family, kind, proto, _, address = (await loop.getaddrinfo(host, reply.port, type=socket.SOCK_STREAM))[0]
        sock = socket.socket(family, kind, proto)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, buffer_bytes)
        try:
            await loop.sock_connect(sock, address)
            await loop.sock_sendall(sock, HELLO.pack(reply.session, reply.token))
            if await loop.sock_recv(sock, 1) != b"\x01":
                raise ConnectionError("the daemon refused the bulk connection")
        except BaseException:
            sock.close()
            raise
        return cls(sock, reply)

    async def send(self, kind: int, meta: bytes, views: Sequence[memoryview] = ()) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, FRAME.pack(kind, len(meta), sum(v.nbytes for v in views)) + meta)
        for v in views:
            await loop.sock_sendall(self.sock, v)

    async def recv_into(self, view: memoryview) -> None:
        loop = asyncio.get_running_loop()
        got = 0
        while got < view.nbytes:
            n = await loop.sock_recv_into(self.sock, view[got:])
            if n == 0:
                raise ConnectionError("the daemon closed the bulk connection")
            got += n

    async def reply(self) -> tuple[int, bytes, int]:
        header = bytearray(FRAME.size)
        await self.recv_into(memoryview(header))
        kind, meta_len, data_len = FRAME.unpack(header)
        meta = bytearray(meta_len)
        await self.recv_into(memoryview(meta))
        return _checked_reply(kind, bytes(meta), data_len)

    async def replies(self, request: pb.GetRequest):
        await self.send(GET, request.SerializeToString())
        while True:
            kind, meta, data_len = await self.reply()
            if kind == END:
                await self.send(RELEASE, b"")
                return
            yield _chunk_reply(kind, meta), data_len

    async def put(self, header: pb.PutHeader, views: Sequence[memoryview]) -> None:
        await self.send(PUT, header.SerializeToString(), views)
        kind, _, _ = await self.reply()
        if kind != DONE:
            raise ConnectionError(f"bulk frame of kind {kind} where DONE was expected")

    def close(self) -> None:
        self.sock.close()


def _bytes(buf) -> np.ndarray:
    return np.frombuffer(buf, dtype=np.uint8)


def _copy_parts(dst: memoryview, views) -> None:
    """Concatenate ``views`` into ``dst``; numpy's copy runs at memcpy speed without the GIL."""
    off = 0
    for v in views:
        np.copyto(_bytes(dst[off : off + v.nbytes]), _bytes(v))
        off += v.nbytes


def _copy(dst: memoryview, src: memoryview) -> None:
    np.copyto(_bytes(dst), _bytes(src))


def _copy_out(dst: memoryview, reply: pb.GetReply, slot: memoryview, pool: memoryview | None) -> None:
    """A chunk's bytes into ``dst``: from the host pool ranges the reply names, else its slot."""
    runs = reply.pool_runs
    if not runs:
        _copy(dst, slot[: reply.chunk_bytes])
        return
    if pool is None or sum(runs[1::2]) != dst.nbytes:
        raise DaemonError(grpc.StatusCode.INTERNAL, "the daemon named host pool ranges that do not fit the chunk")
    off = 0
    for start, length in zip(runs[::2], runs[1::2]):
        _copy(dst[off : off + length], pool[start : start + length])
        off += length


class _StreamSink:
    """Where the chunks of a Get that carries bytes (gRPC pieces or bulk frames) go: into
    ``outs`` (views to fill, or None entries replaced by new buffers)."""

    def __init__(self, outs: list) -> None:
        self.outs, self.got = outs, 0
        self._buf, self._off = None, 0

    def take(self, reply: pb.GetReply, data_len: int, bulk: bool) -> memoryview | None:
        """Place one reply's bytes: inline pieces are copied here; for a bulk frame, the view
        to receive its ``data_len`` bytes into is returned."""
        out = self.outs[reply.index]
        if reply.chunk_bytes:
            if out is not None:
                _check_size(out, reply.chunk_bytes)
            self._buf = out if out is not None else memoryview(bytearray(reply.chunk_bytes))
            self._off = 0
        if bulk:
            if data_len != reply.chunk_bytes:
                raise ConnectionError(f"bulk chunk of {data_len} bytes announced as {reply.chunk_bytes}")
            return self._buf[:data_len]
        data = reply.data  # each access copies: read it once
        self._buf[self._off : self._off + len(data)] = data
        self._off += len(data)
        return None

    def done(self, reply: pb.GetReply) -> None:
        if reply.last:
            if self.outs[reply.index] is None:
                self.outs[reply.index] = self._buf
            self.got += 1


def _check_size(out: memoryview, chunk_bytes: int) -> None:
    if out.nbytes != chunk_bytes:
        raise DaemonError(grpc.StatusCode.INTERNAL, f"chunk of {chunk_bytes} bytes for a {out.nbytes}-byte tensor")


class AsyncClient(_ClientBase):
    """The asyncio client: the same methods as ``Client``, awaitable, on grpc.aio. Bulk frames
    move on the event loop (non-blocking sockets); copies into and out of shared-memory slots
    run in a small thread pool so the loop never waits on a multi-MiB memcpy. Create it inside
    the event loop that uses it."""

    def __init__(
        self,
        addr: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        token_file: str | None = None,
        tls_ca: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 4,
        backoff_s: float = 0.05,
        transport: str = "auto",
        shm_slots: int = 8,
        piece_bytes: int = 4 << 20,
        tune_malloc: bool = True,
        copy_threads: int = 4,
    ) -> None:
        super().__init__(addr, token, token_file, tls_ca, timeout_s, retries, backoff_s, transport,
                         shm_slots, piece_bytes, tune_malloc)
        self._channel = self._channel_for(grpc.aio)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        self._copies = ThreadPoolExecutor(copy_threads, thread_name_prefix="kvstore-copy")
        self._lock = asyncio.Lock()
        self._shm: _Shm | None = None
        self._slots: asyncio.Queue | None = None
        self._shm_tried = False
        self._bulk_idle: list[_AsyncBulkSession] = []

    # -- plumbing -------------------------------------------------------------------------

    async def _rpc(self, method, request):
        try:
            return await method(request, timeout=self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None

    async def _retrying(self, op):
        """``Client._retrying``, awaitable: UNAVAILABLE with backoff; a stale lease or session once."""
        delay, renewed, attempt = self.backoff_s, False, 0
        while True:
            try:
                return await op()
            except DaemonError as exc:
                if self._stale(exc) and not renewed:
                    renewed = True
                    self._drop_transports()
                    continue
                if exc.code != grpc.StatusCode.UNAVAILABLE or attempt == self.retries:
                    raise
            except (ConnectionError, OSError) as exc:
                if attempt == self.retries:
                    self._drop_transports()
                    raise DaemonError(grpc.StatusCode.UNAVAILABLE, f"bulk channel: {exc}") from None
            self._drop_transports()
            await asyncio.sleep(delay)
            delay *= 2
            attempt += 1

    def _drop_transports(self) -> None:
        self._shm, self._slots, self._shm_tried = None, None, False
        idle, self._bulk_idle = self._bulk_idle, []
        for s in idle:
            s.close()

    async def _copy_off_loop(self, fn, *args) -> None:
        await asyncio.get_running_loop().run_in_executor(self._copies, fn, *args)

    # -- transports -----------------------------------------------------------------------

    async def _shm_or_none(self) -> tuple[_Shm, asyncio.Queue] | None:
        if self.transport in ("remote", "grpc"):
            return None
        async with self._lock:
            if self._shm is not None:
                if not self._lease_ok(self._shm):
                    await self._rpc(self._stub.RenewLease, pb.LeaseRef(lease_id=self._shm.lease_id))
                self._shm.last_use = time.monotonic()
                return self._shm, self._slots
            if self._shm_tried and self.transport == "auto":
                return None
            self._shm_tried = True
            try:
                reply = await self._rpc(self._stub.Lease, pb.LeaseRequest(slots=self.shm_slots))
            except DaemonError:
                if self.transport == "shm":
                    raise
                return None
            try:
                shm = _Shm(reply)
            except OSError as exc:
                await self._rpc(self._stub.ReleaseLease, pb.LeaseRef(lease_id=reply.lease_id))
                if self.transport == "shm":
                    raise DaemonError(grpc.StatusCode.FAILED_PRECONDITION,
                                      f"shared memory is not reachable from this host: {exc}") from None
                return None
            slots: asyncio.Queue = asyncio.Queue()
            for _ in range(shm.count):
                slots.put_nowait(shm.free.get_nowait())
            self._shm, self._slots = shm, slots
            return shm, slots

    @staticmethod
    async def _take(slots: asyncio.Queue, want: int) -> list:
        taken = [await slots.get()]
        while len(taken) < want and not slots.empty():
            taken.append(slots.get_nowait())
        return taken

    async def _bulk_take(self) -> _AsyncBulkSession | None:
        if self.transport == "grpc" or not self._bulk_ok:
            return None
        if self._bulk_idle:
            return self._bulk_idle.pop()
        try:
            reply = await self._rpc(self._stub.BulkAttach, pb.BulkAttachRequest())
        except DaemonError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                self._bulk_ok = False
                return None
            raise
        return await asyncio.wait_for(_AsyncBulkSession.open(self.host, reply), self.timeout_s)

    async def path(self) -> str:
        """The transport chunk bytes take now: "shm", "bulk" or "grpc"."""
        if await self._shm_or_none() is not None:
            return "shm"
        session = await self._bulk_take()
        if session is None:
            return "grpc"
        self._bulk_idle.append(session)
        return "bulk"

    # -- put ------------------------------------------------------------------------------

    async def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None,
                  durable: bool = False, codec: str | None = None) -> None:
        await self.put_blob(key, self._encode(key, kv, codec), parent=parent, durable=durable)

    async def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: ChunkKey | bytes | None = None,
                       durable: bool = False) -> None:
        header, views, size = self._put_header(key, parts, parent, durable)
        await self._retrying(lambda: self._put(header, views, size))

    async def _put(self, header: pb.PutHeader, views, size: int) -> None:
        shm = await self._shm_or_none()
        session = await self._bulk_take()
        try:
            if shm is not None and size <= shm[0].slot_bytes:
                (slot,) = await self._take(shm[1], 1)
                try:
                    ref, view = slot
                    await self._copy_off_loop(_copy_parts, view, views)
                    header.slot.CopyFrom(ref)
                    await self._put_request(header, [], session)
                finally:
                    shm[1].put_nowait(slot)
            elif session is not None and size <= session.max_frame_bytes:
                await self._put_request(header, views, session)
            else:
                await self._rpc(self._stub.Put, self._pieces(header, views))
        except BaseException:
            if session is not None:
                session.close()
            raise
        if session is not None:
            self._bulk_idle.append(session)

    async def _put_request(self, header: pb.PutHeader, views, session: _AsyncBulkSession | None) -> None:
        if session is not None:
            await asyncio.wait_for(session.put(header, views), self.timeout_s)
        else:
            await self._rpc(self._stub.Put, iter([pb.PutRequest(header=header)]))

    # -- get ------------------------------------------------------------------------------

    async def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        self._check(key.namespace, out, "out")
        return await self._retrying(lambda: self._get([key], pb.TENSOR, [tensor_bytes(out)])) == 1

    async def get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        ns = self._one_ns(keys)
        if ns is None:
            return []
        outs = [torch.empty(ns.chunk_shape, dtype=getattr(torch, ns.dtype)) for _ in keys]
        return outs[: await self.get_many_into(keys, outs)]

    async def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} buffers for {len(keys)} keys")
        for k, o in zip(keys, outs):
            self._check(k.namespace, o, "out")
        if not keys:
            return 0
        return await self._retrying(lambda: self._get(list(keys), pb.TENSOR, [tensor_bytes(o) for o in outs]))

    async def get_blob(self, key: ChunkKey) -> bytes | None:
        blobs: list = [None]
        if await self._retrying(lambda: self._get([key], pb.BLOB, blobs)) == 0:
            return None
        blob = bytes(blobs[0])
        verify_blob(blob, key, check_payload=False)  # the daemon checked the payload
        return blob

    async def _get(self, keys: list[ChunkKey], payload: int, outs: list) -> int:
        shm = await self._shm_or_none()
        session = await self._bulk_take()
        try:
            if shm is not None and (payload == pb.BLOB or outs[0].nbytes <= shm[0].slot_bytes):
                got = 0
                while got < len(keys):
                    slots = await self._take(shm[1], len(keys) - got)
                    try:
                        n = await asyncio.wait_for(
                            self._get_slots(keys[got : got + len(slots)], payload, outs, got, slots, session,
                                            shm[0].pool),
                            self.timeout_s)
                    finally:
                        for s in slots:
                            shm[1].put_nowait(s)
                    got += n
                    if n < len(slots):
                        break
            else:
                got = await asyncio.wait_for(self._get_stream(keys, payload, outs, session), self.timeout_s)
        except BaseException:
            if session is not None:
                session.close()
            raise
        if session is not None:
            self._bulk_idle.append(session)
        return got

    async def _replies(self, request: pb.GetRequest, session: _AsyncBulkSession | None):
        """``Client._replies``, asynchronously."""
        if session is not None:
            async for item in session.replies(request):
                yield item
            return
        call = self._stub.Get(request, timeout=self.timeout_s, metadata=self._metadata)
        try:
            async for reply in call:
                yield reply, 0
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None
        finally:
            call.cancel()

    async def _get_slots(self, keys, payload, outs, base: int, slots, session, pool) -> int:
        pool_views = pool is not None and session is not None and payload == pb.TENSOR
        request = self._keys_request(pb.GetRequest, keys, payload=payload, slots=[ref for ref, _ in slots],
                                     pool_views=pool_views)
        got = 0
        async for reply, _ in self._replies(request, session):
            i = base + reply.index
            if outs[i] is None:
                outs[i] = bytes(slots[reply.index][1][: reply.chunk_bytes])
            else:
                _check_size(outs[i], reply.chunk_bytes)
                await self._copy_off_loop(_copy_out, outs[i], reply, slots[reply.index][1], pool)
            got += 1
        return got

    async def _get_stream(self, keys, payload, outs, session: _AsyncBulkSession | None) -> int:
        request = self._keys_request(pb.GetRequest, keys, payload=payload, piece_bytes=self.piece_bytes)
        sink = _StreamSink(outs)
        async for reply, data_len in self._replies(request, session):
            view = sink.take(reply, data_len, bulk=session is not None)
            if view is not None:
                await session.recv_into(view)
            sink.done(reply)
        return sink.got

    # -- index operations -----------------------------------------------------------------

    async def _count(self, method, cls, keys, **kw) -> int:
        if not keys:
            return 0
        request = self._keys_request(cls, keys, **kw)
        return (await self._retrying(lambda: self._rpc(method, request))).count

    async def lookup(self, keys: Sequence[ChunkKey]) -> int:
        return await self._count(self._stub.Lookup, pb.KeysRequest, keys)

    async def contains(self, key: ChunkKey) -> bool:
        request = self._keys_request(pb.KeysRequest, [key])
        return (await self._retrying(lambda: self._rpc(self._stub.Contains, request))).present[0]

    async def pin(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        return await self._count(self._stub.Pin, pb.PinRequest, keys, ttl_s=ttl_s)

    async def unpin(self, keys: Sequence[ChunkKey]) -> int:
        return await self._count(self._stub.Unpin, pb.KeysRequest, keys)

    async def prefetch(self, keys: Sequence[ChunkKey], wait: bool = False) -> list[Future]:
        """As ``Client.prefetch``: one completed future per promotion started."""
        count = await self._count(self._stub.Prefetch, pb.PrefetchRequest, keys, wait=wait)
        futures = [Future() for _ in range(count)]
        for f in futures:
            f.set_result(None)
        return futures

    async def delete(self, keys: Sequence[ChunkKey]) -> int:
        return await self._count(self._stub.Delete, pb.KeysRequest, keys)

    async def stats(self) -> StoreStats:
        return stats_from_proto(await self.stats_reply())

    async def stats_reply(self) -> pb.StatsReply:
        return await self._retrying(lambda: self._rpc(self._stub.Stats, pb.StatsRequest()))

    async def ping(self) -> tuple[str, float]:
        stub = health_pb2_grpc.HealthStub(self._channel)
        start = time.perf_counter()
        reply = await self._retrying(lambda: self._rpc(stub.Check, health_pb2.HealthCheckRequest()))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), time.perf_counter() - start

    async def flush(self) -> None:
        """Nothing is buffered client-side: every acknowledged put is in the daemon."""

    async def close(self) -> None:
        shm, self._shm = self._shm, None
        if shm is not None:
            try:
                await self._rpc(self._stub.ReleaseLease, pb.LeaseRef(lease_id=shm.lease_id))
            except DaemonError:
                pass  # the daemon reclaims it when the lease expires
        self._drop_transports()
        await self._channel.close()
        self._copies.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
