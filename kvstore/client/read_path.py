"""A client's reads (get, get_into, get_many_into, get_with, get_blob): where each chunk of a
Get lands. Chunks go into leased slots while there are free ones (raw ones read straight out
of the daemon's host pool, mapped here read-only, pinned there until the Get is released),
then over the bulk socket or a gRPC stream. torch and the blob module are imported in the
methods that make or take tensors and blobs: a client that moves only blobs never loads torch."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import grpc

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client.bulk import BulkSession
from kvstore.client.effects import CancelGet, Copy, NextReply, OpenGet
from kvstore.client.errors import DaemonError
from kvstore.client.options import ClientOptions
from kvstore.client.placing import Lender, StreamSink, check_size, copy_out
from kvstore.client.requests import Requests, check_tensor, one_namespace
from kvstore.client.retries import Retrier
from kvstore.client.shm import ShmLease
from kvstore.client.transports import Transports
from kvstore.keys import ChunkKey, Namespace
from kvstore.wire.frames import END, GET, RELEASE

if TYPE_CHECKING:
    import torch

PIN_MARGIN = 0.9  # of BulkAttachReply.pin_ttl_s: a Get read later than this is discarded


class ReadPath:
    def __init__(self, options: ClientOptions, transports: Transports, retrier: Retrier, requests: Requests) -> None:
        self.options, self.transports, self.retrier, self.requests = options, transports, retrier, requests

    def get_into(self, key: ChunkKey, out: torch.Tensor):
        """Load a chunk into ``out`` (contiguous CPU tensor of the chunk's shape); False on a miss."""
        from kvstore.codecs.raw import tensor_bytes

        check_tensor(key.namespace, out, "out")
        return (yield from self.retrier.run(lambda: self._get([key], pb.TENSOR, [tensor_bytes(out)]))) == 1

    def get(self, keys: Sequence[ChunkKey]):
        """The leading chunks of ``keys`` that are present, in order (stops at the first miss)."""
        ns = one_namespace(keys)
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
            check_tensor(k.namespace, o, "out")
        if not keys:
            return 0
        return (yield from self.retrier.run(
            lambda: self._get(list(keys), pb.TENSOR, [tensor_bytes(o) for o in outs])))

    def get_with(self, keys: Sequence[ChunkKey], consume):
        """Lend each leading present chunk to ``consume`` (``ClientCore.get_with``) out of the
        daemon's host pool where it lies whole; a chunk the pool holds split over pages, or
        that comes in a slot or over the socket, is lent from the slot or a fresh buffer."""
        ns = one_namespace(keys)
        if ns is None:
            return 0
        lender = Lender(ns, consume)
        yield from self.retrier.run(lambda: self._get(list(keys), pb.TENSOR, [None] * len(keys), lender))
        return lender.taken

    def get_blob(self, key: ChunkKey):
        """The verified blob (header + encoded payload) of a chunk, or None on a miss."""
        blobs: list = [None]

        def attempt():
            blobs[0] = None  # a failed attempt may have placed its slot's copy here already
            return self._get([key], pb.BLOB, blobs)

        if (yield from self.retrier.run(attempt)) == 0:
            return None
        from kvstore.blob import verify_blob

        blob = bytes(blobs[0])
        verify_blob(blob, key, check_payload=False)  # the daemon checked the payload
        return blob

    def _get(self, keys: list[ChunkKey], payload: int, outs: list, lender: Lender | None = None):
        """Fill ``outs`` (views to fill, or None entries replaced by buffers), or hand the
        chunks to ``lender``; returns hits. Chunks go into slots while there are free ones,
        then in Gets without slots (read from the mapped pool where they lie raw there, else
        received as bytes)."""
        lease = yield from self.transports.lease()
        session = yield from self.transports.session()
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
            per_get = self._streamed_per_get(keys[0].namespace, payload, lease, session)
            while got < len(keys) and (lender is None or lender.wants()):
                n = min(len(keys) - got, per_get)
                streamed = yield from self._get_stream(keys[got : got + n], payload, outs, got, session, lease, lender)
                got += streamed
                if streamed < n:  # a miss ends the Get
                    break
            ok = True
            return got
        finally:
            yield from self.transports.done_with(session, ok)

    @staticmethod
    def _fits(ns: Namespace, payload: int, out, slot_bytes: int) -> bool:
        """Whether a chunk goes into a slot: a tensor (to fill, or handed over: None) that
        fits, or a blob whose raw encoding does (the daemon refuses a blob larger than its
        slot, it does not fall back)."""
        if payload == pb.BLOB:
            from kvstore.blob import HEADER_BYTES

            return ns.chunk_bytes + HEADER_BYTES <= slot_bytes
        return (ns.chunk_bytes if out is None else out.nbytes) <= slot_bytes

    def _get_in_slots(self, keys, payload, outs, base: int, lease: ShmLease, slots, session,
                      lender: Lender | None = None):
        """Chunks placed in ``slots``, or (pool mapped, bulk channel) read straight out of the
        daemon's host pool, pinned there until the session sends RELEASE."""
        with self.transports.using(lease, slots):  # every slot taken comes back, whatever fails first
            pool_views = lease.pool is not None and session is not None and payload == pb.TENSOR
            request = self.requests.keys_request(pb.GetRequest, keys, payload=payload,
                                                 slots=[ref for ref, _ in slots], pool_views=pool_views)
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

    @staticmethod
    def _streamed_per_get(ns: Namespace, payload: int, lease: ShmLease | None, session: BulkSession | None) -> int:
        """Chunks one Get without slots names: with pool views, as many as the daemon pins for
        one Get (``BulkAttachReply.max_pinned_bytes``), since the rest would come as bytes;
        else all."""
        if not _pool_views(payload, lease, session):
            return 1 << 62
        return max(1, session.max_pinned_bytes // ns.chunk_bytes)

    def _get_stream(self, keys, payload, outs, base: int, session: BulkSession | None, lease: ShmLease | None,
                    lender: Lender | None):
        """Chunks as bytes (bulk frames, or gRPC pieces); on a bulk session with the daemon's
        host pool mapped (``lease.pool``), a tensor chunk raw there comes as its pool ranges instead
        (pool views, no slot needed), read out of the pool while the daemon keeps it pinned:
        so a chunk larger than a slot, or one of a Get that found every slot busy, is not
        copied into a socket and out of it again. The request names the ``lease`` the pool was
        mapped with: the daemon refuses one it does not know (mapped before a restart, the
        pool there holds other bytes). ``lender`` is handed every chunk there."""
        pool = lease.pool if lease is not None else None
        pool_views = _pool_views(payload, lease, session)
        request = self.requests.keys_request(pb.GetRequest, keys, payload=payload,
                                             piece_bytes=self.options.piece_bytes, pool_views=pool_views,
                                             pool_lease=lease.lease_id if pool_views else 0)
        sink = StreamSink(outs[base : base + len(keys)])
        pooled: dict[int, pb.GetReply] = {}  # index in sink.outs -> reply naming pool ranges

        def place(reply: pb.GetReply, data_len: int):
            if reply.pool_runs:
                pooled[reply.index] = sink.pooled(reply, data_len)
                return
            view = sink.take(reply, data_len, bulk=session is not None)
            if view is not None:
                yield from session.recv_into(view)
            sink.done(reply)

        def read_pooled():  # every reply is in, and the pool ranges are still pinned
            if lender is not None:
                yield Copy(lender.lend_streamed, (sink.outs, pooled, pool, base))
            elif pooled:
                yield Copy(copy_out, (sink.pooled_into(pooled), pool))

        yield from self._each_reply(request, session, place, read_pooled)
        if lender is None:
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


def _pool_views(payload: int, lease: ShmLease | None, session: BulkSession | None) -> bool:
    """Whether a Get without slots asks for pool views: tensors, on a bulk session, with the
    daemon's pool mapped, from a daemon that pins for a Get (one from before pool views
    without slots, or one that pins nothing, tells 0 and gets every chunk as bytes)."""
    return (payload == pb.TENSOR and lease is not None and lease.pool is not None and session is not None
            and session.max_pinned_bytes > 0)
