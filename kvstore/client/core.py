"""The client, written once: request building, transport choice and retry decisions.

Every operation is a generator that yields I/O effects (kvstore/client/effects.py) and
returns the operation's result; the sync front (kvstore/client/sync.py) performs each effect
blocking, the async front (kvstore/client/aio.py) awaits it. So a fix here is a fix in both.

Chunk bytes take the fastest path available, chosen once per client:

- ``shm``: the daemon runs on this host (we can map its slot arena and read its nonce): a
  put's blob is copied into a leased shared-memory slot and only the slot reference
  travels; a get copies raw chunks straight out of the daemon's host pool (mapped
  read-only), others out of slots;
- ``bulk``: chunk bytes on a plain TCP connection attached with a one-time token;
- ``grpc``: bytes pieces inside gRPC messages (works everywhere, TLS included).

Gets and puts go over a bulk channel whenever the daemon offers one (shm included: gRPC
costs about as much per message as moving a 4 MiB chunk), else over gRPC. A request never
waits for a slot: with all of them busy it takes the socket path, and one whose bulk
connection is closed before the daemon's hello reply (a flood of connections without a
token fills the daemon's room for such connections) takes gRPC; bulk is tried again a
second later, the wait doubling up to a minute while it fails.
Retries: only UNAVAILABLE and a broken bulk connection, with exponential backoff (every
operation is idempotent); a lease or bulk session the daemon no longer knows is replaced
once, at once.

torch (and the blob and codec modules, which need it) is imported in the methods that take
or make tensors, not with this module: ``kvstore ping`` and ``stats`` start in a fraction of
a second, and a client that moves only blobs never loads it.

State shared by threads (the lease, idle sessions) changes only under ``_lock``, never held
across an effect, so the same core serves a thread-safe ``Client`` and an ``AsyncClient``.
The fronts run every operation through ``call``, so that ``close`` can refuse new calls and
wait for those in flight before it gives the lease and the sessions back.
"""

from __future__ import annotations

import secrets
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import TYPE_CHECKING, Sequence

import grpc
from grpc_health.v1 import health_pb2

from kvstore._proto import kvstore_pb2 as pb
from kvstore.client.bulk import BulkSession
from kvstore.client.effects import CallsDone, CancelGet, Copy, NextReply, OpenGet, Rpc, Sleep
from kvstore.client.errors import RAISE, RENEW, DaemonError, decide, slots_reusable
from kvstore.client.options import ClientOptions
from kvstore.client.placing import Lender, StreamSink, check_size, copy_out, copy_parts
from kvstore.client.shm import ShmLease
from kvstore.keys import HASH_BYTES, ChunkKey, Namespace
from kvstore.malloc import keep_large_blocks_in_heap
from kvstore.wire.auth import bearer, read_token_file
from kvstore.wire.convert import ns_to_proto, split_host_port, stats_from_proto
from kvstore.wire.frames import DONE, END, GET, PUT, RELEASE

if TYPE_CHECKING:
    import torch

PIN_MARGIN = 0.9  # of BulkAttachReply.pin_ttl_s: a Get read later than this is discarded
LEASE_AGAIN_S = 1.0  # after the daemon had no free slots for a lease
BULK_AGAIN_S = (1.0, 60.0)  # after a bulk connection did not attach: gRPC meanwhile, doubling per failure
UNANSWERED_KEPT = 16  # Lease requests without an answer to release by id: the latest so many


class ClientCore:
    def __init__(self, addr: str, options: ClientOptions) -> None:
        self.addr, self.options = addr, options
        self.host, _ = split_host_port(addr)
        if options.tune_malloc:
            keep_large_blocks_in_heap()
        token = read_token_file(options.token_file) if options.token_file else options.token
        self.metadata = (bearer(token),) if token else ()
        self.tls = None  # (root certificates, private key, certificate chain) for TLS
        if options.tls_ca:
            self.tls = tuple(None if p is None else open(p, "rb").read()
                             for p in (options.tls_ca, options.tls_key, options.tls_cert))
        self._lock = threading.Lock()
        self._lease: ShmLease | None = None
        self._shm_tried = False  # and found shared memory out of reach (another host, shm off)
        self._lease_again_at = 0.0  # after "no free slots": when to ask again
        self._retired: list[ShmLease] = []  # leases to release once every slot of theirs came back
        self._unanswered: list[int] = []  # Lease requests that got no answer: released by their id
        self._idle: list[BulkSession] = []
        self._bulk_ok = not options.tls_ca  # the bulk channel is not encrypted
        self._bulk_again_at = 0.0  # after a bulk connection that did not attach: when to try again
        self._bulk_failed = 0  # bulk connections in a row that did not attach
        self._namespaces: dict[bytes, Namespace] = {}
        self._calls = 0  # operations running now (``call``)
        self._closing = False  # ``close`` began: new operations are refused
        self._calls_done = threading.Condition(self._lock)

    # -- calls ------------------------------------------------------------------------------

    def call(self, op):
        """Run the operation ``op`` (a generator of this core) as one call of the client:
        refused once ``close`` began, counted until it ends so that ``close`` waits for it."""
        with self._lock:
            if self._closing:
                raise DaemonError(grpc.StatusCode.CANCELLED, "the client is closed")
            self._calls += 1
        try:
            return (yield from op)
        finally:
            with self._lock:
                self._calls -= 1
                self._calls_done.notify_all()

    def wait_calls_done(self) -> None:
        """Block until no operation runs (``close`` refuses new ones first)."""
        with self._lock:
            self._calls_done.wait_for(lambda: self._calls == 0)

    # -- requests ---------------------------------------------------------------------------

    def _ns(self, ns: Namespace) -> pb.NamespaceSpec:
        self._namespaces.setdefault(ns.fingerprint, ns)
        return ns_to_proto(ns)

    @staticmethod
    def _one_ns(keys: Sequence[ChunkKey]) -> Namespace | None:
        if not keys:
            return None
        ns = keys[0].namespace
        if any(k.namespace != ns for k in keys):
            raise ValueError("all keys of one call must share a namespace")
        return ns

    def _keys_request(self, cls, keys: Sequence[ChunkKey], **kw):
        return cls(namespace=self._ns(self._one_ns(keys)), prefix_hashes=[k.prefix_hash for k in keys], **kw)

    @staticmethod
    def _check(ns: Namespace, tensor: torch.Tensor, what: str) -> None:
        if tuple(tensor.shape) != ns.chunk_shape or str(tensor.dtype).removeprefix("torch.") != ns.dtype:
            raise ValueError(f"{what} {tensor.dtype}{list(tensor.shape)} does not match namespace "
                             f"{ns.dtype}{list(ns.chunk_shape)}")

    def _key_of(self, key: ChunkKey | bytes) -> ChunkKey:
        if isinstance(key, ChunkKey):
            return key
        ns = self._namespaces.get(bytes(key[:HASH_BYTES]))
        if ns is None or len(key) != 2 * HASH_BYTES:
            raise ValueError("put_blob needs a ChunkKey, or the id of a key whose namespace this client has used")
        return ChunkKey(ns, bytes(key[HASH_BYTES:]))

    def _pieces(self, header: pb.PutHeader, views):
        """The header, then the blob in pieces of ``piece_bytes`` across its parts (header and
        payload): the daemon refuses a piece below its ``limits.min_piece_bytes`` that is not
        the last, and a part per piece sent the blob's small header part as one."""
        yield pb.PutRequest(header=header)
        piece, room = [], self.options.piece_bytes
        for v in views:
            off = 0
            while off < v.nbytes:
                take = min(room, v.nbytes - off)
                piece.append(v[off : off + take])
                off, room = off + take, room - take
                if not room:
                    yield pb.PutRequest(data=b"".join(piece))
                    piece, room = [], self.options.piece_bytes
        if piece:
            yield pb.PutRequest(data=b"".join(piece))

    # -- retries ----------------------------------------------------------------------------

    def _retrying(self, attempt_once):
        """Run ``attempt_once()`` (a generator) until it succeeds or ``decide`` gives up,
        resetting the transports between attempts."""
        delay, renewed, attempt = self.options.backoff_s, False, 0
        while True:
            try:
                return (yield from attempt_once())
            except (DaemonError, OSError) as exc:
                decision = decide(exc, attempt, renewed, self.options.retries)
                if decision == RAISE:
                    if isinstance(exc, OSError):
                        raise DaemonError(grpc.StatusCode.UNAVAILABLE, f"bulk channel: {exc}") from None
                    raise
            yield from self._drop_transports()
            if decision == RENEW:
                renewed = True
                continue
            yield Sleep(delay)
            delay *= 2
            attempt += 1

    def _call(self, method: str, request, health: bool = False):
        def once():
            return (yield Rpc(method, request, health))

        return (yield from self._retrying(once))

    # -- transports -------------------------------------------------------------------------

    def _shm(self):
        """This client's lease, taken the first time (None: not on the daemon's host, or
        shared memory is not wanted)."""
        if self.options.transport in ("remote", "grpc"):
            return None
        yield from self._release_retired()
        lease = self._lease
        if lease is not None:
            if not lease.fresh():
                asked = lease.clock()
                yield Rpc("RenewLease", pb.LeaseRef(lease_id=lease.lease_id))
                lease.renewed(asked)
            return lease
        if self.options.transport == "auto" and (self._shm_tried or time.monotonic() < self._lease_again_at):
            return None
        request_id = secrets.randbits(63) or 1
        try:
            reply = yield Rpc("Lease", pb.LeaseRequest(slots=self.options.shm_slots, request_id=request_id))
        except BaseException as exc:
            if not slots_reusable(exc):  # no answer (a deadline, a cancellation): it may be granted all the same
                with self._lock:
                    self._unanswered = (self._unanswered + [request_id])[-UNANSWERED_KEPT:]
            if not isinstance(exc, DaemonError):
                raise
            if self.options.transport == "shm" or exc.code == grpc.StatusCode.UNAVAILABLE:
                raise  # unreachable now (restarting, say), not "no shared memory": the call is retried
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED or not slots_reusable(exc):  # all slots leased
                self._lease_again_at = time.monotonic() + LEASE_AGAIN_S
            else:
                self._shm_tried = True
            return None
        try:
            lease = ShmLease(reply)
        except OSError as exc:
            self._shm_tried = True  # not on the daemon's host
            yield Rpc("ReleaseLease", pb.LeaseRef(lease_id=reply.lease_id))
            if self.options.transport == "shm":
                raise DaemonError(grpc.StatusCode.FAILED_PRECONDITION,
                                  f"shared memory is not reachable from this host: {exc}") from None
            return None
        with self._lock:
            if self._lease is None:
                self._lease = lease
                return lease
            lease.retire()  # another thread leased meanwhile
            self._retired.append(lease)
            return self._lease

    def _retire(self, lease: ShmLease) -> None:
        """Never hand out this lease's slots again (see kvstore/client/shm.py)."""
        with self._lock:
            if self._lease is lease:
                self._lease, self._shm_tried = None, False
            if lease.retire():
                self._retired.append(lease)

    def _release_retired(self):
        """Release the retired leases none of whose slots a request of this client still
        uses (the others wait for a later call, or expire at the daemon), and whatever the
        Lease requests that got no answer were granted. Interrupted (KeyboardInterrupt, a
        cancellation), it keeps what it has not released yet for the next call or ``close``
        (releasing one twice is harmless: the daemon ignores a lease it no longer has)."""
        with self._lock:
            ready = [lease for lease in self._retired if lease.releasable()]
            self._retired = [lease for lease in self._retired if lease not in ready]
            unanswered, self._unanswered = self._unanswered, []
        refs = [pb.LeaseRef(request_id=r) for r in unanswered]
        refs += [pb.LeaseRef(lease_id=lease.lease_id) for lease in ready]
        for n, ref in enumerate(refs):
            try:
                yield Rpc("ReleaseLease", ref)
            except DaemonError:
                pass  # a lease not released expires at the daemon
            except BaseException:
                with self._lock:
                    self._unanswered = (unanswered[n:] + self._unanswered)[-UNANSWERED_KEPT:]
                    self._retired += ready[max(0, n - len(unanswered)):]
                raise

    def _session(self):
        """An attached bulk session (idle or new), or None where there is none to have."""
        if self.options.transport == "grpc" or not self._bulk_ok:
            return None
        with self._lock:
            if self._idle:
                return self._idle.pop()  # attached already: a flood does not touch it
        if time.monotonic() < self._bulk_again_at:
            return None
        try:
            reply = yield Rpc("BulkAttach", pb.BulkAttachRequest())
        except DaemonError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                self._bulk_ok = False  # the daemon has no bulk channel: use gRPC
                return None
            if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                return None  # too many sessions right now: this call uses gRPC
            raise
        try:
            session = yield from BulkSession.open(self.host, reply)
        except OSError:
            # Closed or refused before the hello reply: anyone can fill the daemon's room for
            # connections without a token (max_unauthenticated), and retrying on that port
            # would fail the call. This call uses gRPC; bulk is tried again later, and less
            # often while it keeps failing (a port that times out costs a whole timeout).
            first, most = BULK_AGAIN_S
            self._bulk_again_at = time.monotonic() + min(most, first * 2 ** self._bulk_failed)
            self._bulk_failed += 1
            return None
        self._bulk_failed = 0
        return session

    def _done_with(self, session: BulkSession | None, ok: bool):
        """Keep a session for the next call, or close it: after a failure its state is unknown."""
        if session is None:
            return
        if ok:
            with self._lock:
                self._idle.append(session)
        else:
            yield from session.close()

    def _drop_transports(self):
        with self._lock:
            lease, idle, self._idle = self._lease, self._idle, []
        if lease is not None:
            self._retire(lease)
        for session in idle:
            yield from session.close()

    def path(self):
        """The transport chunk bytes take now: "shm", "bulk" or "grpc"."""
        if (yield from self._shm()) is not None:
            return "shm"
        session = yield from self._session()
        yield from self._done_with(session, True)
        return "grpc" if session is None else "bulk"

    # -- put --------------------------------------------------------------------------------

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None, durable: bool = False,
            codec=None):
        """Store one chunk (encoded here, verified by the daemon); ``codec`` as ``Store.put``'s."""
        from kvstore.blob import encode_header
        from kvstore.codecs import resolve_codec

        self._check(key.namespace, kv, "chunk")
        chosen = resolve_codec(codec or "raw")
        kv = kv.detach().to("cpu").contiguous()
        payload = chosen.encode(kv)
        parts = [encode_header(key, chosen.codec_id, kv.dtype, kv.shape, payload), payload]
        yield from self.put_blob(key, parts, parent=parent, durable=durable)

    def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: ChunkKey | bytes | None = None,
                 durable: bool = False):
        """Store an encoded blob (header + payload, possibly in pieces)."""
        key = self._key_of(key)
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        parent_hash = b""
        if parent is not None:
            parent_hash = parent.prefix_hash if isinstance(parent, ChunkKey) else bytes(parent[HASH_BYTES:])
        header = pb.PutHeader(namespace=self._ns(key.namespace), prefix_hash=key.prefix_hash,
                              parent_hash=parent_hash, durable=durable, blob_bytes=size)
        yield from self._retrying(lambda: self._put(header, views, size))

    def _put(self, template: pb.PutHeader, views, size: int):
        header = pb.PutHeader()
        header.CopyFrom(template)  # an attempt may name a slot; the next one may not
        lease = yield from self._shm()
        session = yield from self._session()
        ok = False
        try:
            slots = lease.take(1) if lease is not None and size <= lease.slot_bytes else []
            if slots:
                yield from self._put_in_slot(header, views, lease, slots, session)
            elif session is not None and size <= session.max_frame_bytes:
                yield from self._put_request(header, views, session)
            else:
                yield Rpc("Put", self._pieces(header, views))
            ok = True
        finally:
            yield from self._done_with(session, ok)

    @contextmanager
    def _using(self, lease: ShmLease, slots):
        """Give ``slots`` back once their request is over; retire the lease if the request
        ended without an answer (the daemon may still be using them)."""
        try:
            yield
        except BaseException as exc:
            if not slots_reusable(exc):
                self._retire(lease)
            raise
        finally:
            lease.give(slots)

    def _put_in_slot(self, header: pb.PutHeader, views, lease: ShmLease, slots, session):
        ((ref, view),) = slots
        with self._using(lease, slots):
            yield Copy(copy_parts, (view, views))
            header.slot.CopyFrom(ref)
            yield from self._put_request(header, [], session)

    def _put_request(self, header: pb.PutHeader, views, session: BulkSession | None):
        """A Put whose blob is in a slot (no ``views``) or in ``views``, on the bulk channel or gRPC."""
        if session is None:
            yield Rpc("Put", iter([pb.PutRequest(header=header)]))
            return
        yield from session.send(PUT, header.SerializeToString(), views)
        kind, _, _ = yield from session.reply()
        if kind != DONE:
            raise ConnectionError(f"bulk frame of kind {kind} where DONE was expected")

    # -- get --------------------------------------------------------------------------------

    def get_into(self, key: ChunkKey, out: torch.Tensor):
        """Load a chunk into ``out`` (contiguous CPU tensor of the chunk's shape); False on a miss."""
        from kvstore.codecs.raw import tensor_bytes

        self._check(key.namespace, out, "out")
        return (yield from self._retrying(lambda: self._get([key], pb.TENSOR, [tensor_bytes(out)]))) == 1

    def get(self, keys: Sequence[ChunkKey]):
        """The leading chunks of ``keys`` that are present, in order (stops at the first miss)."""
        ns = self._one_ns(keys)
        if ns is None:
            return []
        import torch

        outs = [torch.empty(ns.chunk_shape, dtype=getattr(torch, ns.dtype)) for _ in keys]
        return outs[: (yield from self.get_many_into(keys, outs))]

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]):
        """Load the leading present chunks into ``outs`` (reused buffers); returns how many.
        When it returns (or raises), nothing writes into ``outs`` any more."""
        from kvstore.codecs.raw import tensor_bytes

        if len(outs) != len(keys):
            raise ValueError(f"{len(outs)} buffers for {len(keys)} keys")
        for k, o in zip(keys, outs):
            self._check(k.namespace, o, "out")
        if not keys:
            return 0
        return (yield from self._retrying(lambda: self._get(list(keys), pb.TENSOR, [tensor_bytes(o) for o in outs])))

    def get_with(self, keys: Sequence[ChunkKey], consume):
        """Hand each leading present chunk of ``keys`` to ``consume(index, tensor)`` as a
        read-only tensor of the chunk's shape, valid only during the call; ``consume``
        returns False to take no more. Returns how many it took.

        Why: a caller that copies a chunk somewhere anyway (the vLLM connector, into its paged
        cache) reads it straight out of the daemon's host pool, mapped here read-only and
        pinned until the Get is released: one copy instead of two (pool to buffer, buffer to
        blocks). A chunk the pool holds split over pages, or that comes in a slot or over the
        socket, is handed over from the slot or a fresh buffer instead."""
        ns = self._one_ns(keys)
        if ns is None:
            return 0
        lender = Lender(ns, consume)
        yield from self._retrying(lambda: self._get(list(keys), pb.TENSOR, [None] * len(keys), lender))
        return lender.taken

    def get_blob(self, key: ChunkKey):
        """The verified blob (header + encoded payload) of a chunk, or None on a miss."""
        blobs: list = [None]

        def attempt():
            blobs[0] = None  # a failed attempt may have placed its slot's copy here already
            return self._get([key], pb.BLOB, blobs)

        if (yield from self._retrying(attempt)) == 0:
            return None
        from kvstore.blob import verify_blob

        blob = bytes(blobs[0])
        verify_blob(blob, key, check_payload=False)  # the daemon checked the payload
        return blob

    def _get(self, keys: list[ChunkKey], payload: int, outs: list, lender: Lender | None = None):
        """Fill ``outs`` (views to fill, or None entries replaced by buffers), or hand the
        chunks to ``lender``; returns hits. Chunks go into slots while there are free ones,
        then over the socket."""
        lease = yield from self._shm()
        session = yield from self._session()
        ok = False
        try:
            got = 0
            slotted = lease is not None and self._fits(keys[0].namespace, payload, outs[0], lease.slot_bytes)
            while slotted and got < len(keys) and (lender is None or lender.wants()):
                slots = lease.take(len(keys) - got)
                if not slots:
                    break
                n = yield from self._get_in_slots(keys[got : got + len(slots)], payload, outs, got, lease, slots,
                                                  session, lender)
                got += n
                if n < len(slots):  # a miss ends the Get
                    ok = True
                    return got
            if got < len(keys) and (lender is None or lender.wants()):
                streamed = yield from self._get_stream(keys[got:], payload, outs, got, session)
                if lender is not None:
                    yield Copy(lender.lend_buffers, (outs, got, got + streamed))
                got += streamed
            ok = True
            return got
        finally:
            yield from self._done_with(session, ok)

    @staticmethod
    def _fits(ns: Namespace, payload: int, out, slot_bytes: int) -> bool:
        """Whether a chunk goes into a slot: a tensor (to fill, or handed over: None) that
        fits, or a blob whose raw encoding does (the daemon refuses a blob larger than its slot, it does not fall back)."""
        if payload == pb.BLOB:
            from kvstore.blob import HEADER_BYTES

            return ns.chunk_bytes + HEADER_BYTES <= slot_bytes
        return (ns.chunk_bytes if out is None else out.nbytes) <= slot_bytes

    def _get_in_slots(self, keys, payload, outs, base: int, lease: ShmLease, slots, session,
                      lender: Lender | None = None):
        """Chunks placed in ``slots``, or (pool mapped, bulk channel) read straight out of the
        daemon's host pool, pinned there until the session sends RELEASE."""
        with self._using(lease, slots):  # every slot taken comes back, whatever fails first
            pool_views = lease.pool is not None and session is not None and payload == pb.TENSOR
            request = self._keys_request(pb.GetRequest, keys, payload=payload, slots=[ref for ref, _ in slots],
                                         pool_views=pool_views)
            got = 0
            placed = []  # (dst, reply, slot): copied all at once when every reply is in

            def place(reply: pb.GetReply, data_len: int):
                nonlocal got
                if not 0 <= reply.index < len(slots) or data_len:
                    raise ConnectionError(f"unexpected reply for slot {reply.index} with {data_len} bytes")
                i = base + reply.index
                slot = slots[reply.index][1]
                if lender is not None:
                    placed.append((i, reply, slot))
                elif outs[i] is None:
                    if reply.chunk_bytes > slot.nbytes:
                        raise DaemonError(grpc.StatusCode.INTERNAL, "a blob larger than its slot")
                    outs[i] = bytes(slot[: reply.chunk_bytes])
                else:
                    check_size(outs[i], reply.chunk_bytes)
                    placed.append((outs[i], reply, slot))
                got += 1
                yield from ()

            def copy_placed():
                if placed and lender is not None:
                    yield Copy(lender.lend_placed, (placed, lease.pool))
                elif placed:
                    yield Copy(copy_out, (placed, lease.pool))

            yield from self._each_reply(request, session, place, copy_placed)
            return got

    def _get_stream(self, keys, payload, outs, base: int, session: BulkSession | None):
        request = self._keys_request(pb.GetRequest, keys, payload=payload, piece_bytes=self.options.piece_bytes)
        sink = StreamSink(outs[base : base + len(keys)])

        def place(reply: pb.GetReply, data_len: int):
            view = sink.take(reply, data_len, bulk=session is not None)
            if view is not None:
                yield from session.recv_into(view)
            sink.done(reply)

        yield from self._each_reply(request, session, place)
        outs[base : base + len(keys)] = sink.outs
        return sink.got

    def _each_reply(self, request: pb.GetRequest, session: BulkSession | None, place, read_pinned=None):
        """Send a Get and run ``place(reply, data_len)`` (a generator) for each chunk reply:
        on the bulk session (read ``data_len`` bytes there before the next), else on a gRPC
        stream (data inline). ``read_pinned()`` (a generator) runs after the last reply,
        while what the replies named is still pinned."""
        if session is None:
            stream = yield OpenGet(request)
            try:
                while (reply := (yield NextReply(stream))) is not None:
                    yield from place(reply, 0)
            finally:
                yield CancelGet(stream)  # a no-op once the stream ended; stops it when we give up
            if read_pinned is not None:
                yield from read_pinned()
            return
        sent = time.monotonic()
        yield from session.send(GET, request.SerializeToString())
        while True:
            kind, meta, data_len = yield from session.reply()
            if kind == END:
                break
            yield from place(session.chunk(kind, meta), data_len)
        if read_pinned is not None:
            yield from read_pinned()
        # only pool views are read out of pages the daemon pinned for us (bytes in frames hold no pin)
        if request.pool_views and time.monotonic() - sent > session.pin_ttl_s * PIN_MARGIN:
            raise ConnectionError("this Get's data was read after the daemon may have unpinned it; discarded")
        yield from session.send(RELEASE)

    # -- index operations -------------------------------------------------------------------

    def _count(self, method: str, cls, keys: Sequence[ChunkKey], **kw):
        if not keys:
            return 0
        return (yield from self._call(method, self._keys_request(cls, keys, **kw))).count

    def lookup(self, keys: Sequence[ChunkKey]):
        """How many leading keys are present."""
        return (yield from self._count("Lookup", pb.KeysRequest, keys))

    def contains(self, key: ChunkKey):
        return (yield from self._call("Contains", self._keys_request(pb.KeysRequest, [key]))).present[0]

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float):
        if not ttl_s > 0:  # as the in-process Store: a pin without a lease is the caller's error
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        return (yield from self._count("Pin", pb.PinRequest, keys, ttl_s=ttl_s))

    def unpin(self, keys: Sequence[ChunkKey]):
        return (yield from self._count("Unpin", pb.KeysRequest, keys))

    def prefetch(self, keys: Sequence[ChunkKey], wait: bool = False):
        """Ask the daemon to promote chunks held only in slower tiers; one completed future per
        promotion started or already running (with ``wait``: once they are done)."""
        count = yield from self._count("Prefetch", pb.PrefetchRequest, keys, wait=wait)
        futures = [Future() for _ in range(count)]
        for f in futures:
            f.set_result(None)
        return futures

    def delete(self, keys: Sequence[ChunkKey]):
        return (yield from self._count("Delete", pb.KeysRequest, keys))

    def pause(self, session: str, keys: Sequence[ChunkKey], expected_s: float | None = None,
              ttl_s: float | None = None):
        """An agent session paused (advisory): the daemon pins ``keys`` (one namespace) for the
        lease (``ttl_s``, else from the expected stall) and remembers them under ``session``,
        so a later ``resume_soon`` by session id alone warms them; the count pinned."""
        return (yield from self._count("Pause", pb.PauseRequest, keys, session=session,
                                       expected_s=expected_s or 0.0, ttl_s=ttl_s or 0.0))

    def resume_soon(self, session: str, eta_s: float = 0.0):
        """The session's next turn comes in about ``eta_s`` (advisory): the daemon prefetches
        the chunks it paused with into host RAM; the promotions started (0: unknown session)."""
        return (yield from self._call("ResumeSoon", pb.ResumeRequest(session=session, eta_s=eta_s))).count

    def stats_reply(self):
        """The daemon's full stats message (Store stats plus address, free slots, sessions)."""
        return (yield from self._call("Stats", pb.StatsRequest()))

    def stats(self):
        return stats_from_proto((yield from self.stats_reply()))

    def config(self):
        """The daemon's effective configuration as TOML (``load_config`` reads it)."""
        return (yield from self._call("Config", pb.ConfigRequest())).toml

    def ping(self):
        """The daemon's health status name and the round-trip time in seconds."""
        start = time.perf_counter()
        reply = yield from self._call("Check", health_pb2.HealthCheckRequest(), health=True)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status), time.perf_counter() - start

    def close(self):
        """Refuse new calls, wait for those in flight (they may still copy into or out of
        slots, and into their callers' memory), then release the lease (and any retired
        one) and close the bulk sessions."""
        with self._lock:
            self._closing = True
        yield CallsDone()
        with self._lock:
            lease, self._lease = self._lease, None
        if lease is not None:
            self._retire(lease)
        yield from self._release_retired()
        yield from self._drop_transports()


MAX_MESSAGE_BYTES = 64 << 20


def channel_for(core: ClientCore, module):
    """A channel of ``grpc`` or ``grpc.aio`` with the client's options and credentials."""
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    if core.tls is None:
        return module.insecure_channel(core.addr, options=options)
    root, key, chain = core.tls
    creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
    return module.secure_channel(core.addr, creds, options=options)
