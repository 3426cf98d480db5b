"""A client's puts: the chunk encoded here into a blob, which travels in a leased slot (only
the slot reference on the wire), in one bulk frame, or in gRPC pieces; the daemon verifies
it. torch and the codecs are imported in ``put``: a client that moves only blobs never
loads them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client.bulk import BulkSession
from kvstore.client.effects import Copy, Rpc
from kvstore.client.options import ClientOptions
from kvstore.client.placing import copy_parts, seal_into
from kvstore.client.requests import Requests, check_tensor
from kvstore.client.retries import Retrier
from kvstore.client.shm import ShmLease
from kvstore.client.transports import Transports
from kvstore.keys import HASH_BYTES, ChunkKey
from kvstore.wire.frames import DONE, PUT

if TYPE_CHECKING:
    import torch


class PutPath:
    def __init__(self, options: ClientOptions, transports: Transports, retrier: Retrier, requests: Requests) -> None:
        self.options, self.transports, self.retrier, self.requests = options, transports, retrier, requests

    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None, durable: bool = False,
            codec=None):
        """Encode ``kv`` with ``codec`` (raw by default) and store the blob."""
        from kvstore.blob import UnsealedBlob
        from kvstore.codecs import resolve_codec

        check_tensor(key.namespace, kv, "chunk")
        chosen = resolve_codec(codec or "raw")
        kv = kv.detach().to("cpu").contiguous()
        blob = UnsealedBlob(key, chosen.codec_id, kv.dtype, kv.shape, chosen.encode(kv), self.options.blob_version)
        yield from self._put_content(key, _Unsealed(blob), parent, durable)

    def put_blob(self, key: ChunkKey | bytes, parts: Sequence, *, parent: ChunkKey | bytes | None = None,
                 durable: bool = False):
        """Store a blob given in ``parts`` (header + payload, possibly in pieces), retried."""
        key = self.requests.key_of(key)
        yield from self._put_content(key, _Sealed([memoryview(p).cast("B") for p in parts]), parent, durable)

    def _put_content(self, key: ChunkKey, content: "_Sealed | _Unsealed", parent: ChunkKey | bytes | None,
                     durable: bool):
        parent_hash = b""
        if parent is not None:
            parent_hash = parent.prefix_hash if isinstance(parent, ChunkKey) else bytes(parent[HASH_BYTES:])
        header = pb.PutHeader(namespace=self.requests.namespace(key.namespace), prefix_hash=key.prefix_hash,
                              parent_hash=parent_hash, durable=durable, blob_bytes=content.size)
        yield from self.retrier.run(lambda: self._put(header, content))

    def _put(self, template: pb.PutHeader, content: "_Sealed | _Unsealed"):
        header = pb.PutHeader()
        header.CopyFrom(template)  # an attempt may name a slot; the next one may not
        lease = yield from self.transports.lease()
        session = yield from self.transports.session()
        ok = False
        try:
            slots = lease.take(1) if lease is not None and content.size <= lease.slot_bytes else []
            if slots:
                yield from self._put_in_slot(header, content, lease, slots, session)
            elif session is not None and content.size <= session.max_frame_bytes:
                yield from self._put_request(header, content.views(), session)
            else:
                yield Rpc("Put", self._pieces(header, content.views()))
            ok = True
        finally:
            yield from self.transports.done_with(session, ok)

    def _put_in_slot(self, header: pb.PutHeader, content: "_Sealed | _Unsealed", lease: ShmLease, slots, session):
        ((ref, view),) = slots
        with self.transports.using(lease, slots):
            yield Copy(content.fill, (view,))
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


class _Sealed:
    """A blob given whole (header + payload, in ``views``)."""

    def __init__(self, views: list[memoryview]) -> None:
        self._views = views
        self.size = sum(v.nbytes for v in views)

    def views(self) -> list[memoryview]:
        return self._views

    def fill(self, dst: memoryview) -> None:
        copy_parts(dst, self._views)


class _Unsealed:
    """A blob whose header is packed from its payload's checksum: into a slot, in the same
    pass as the copy (``seal_into``); for the socket, by a hash pass of its own, once."""

    def __init__(self, blob) -> None:
        self.blob = blob
        self.size = blob.size
        self._head: bytes | None = None

    def views(self) -> list[memoryview]:
        from kvstore.blob import encode_header

        blob = self.blob
        if self._head is None:
            self._head = encode_header(blob.key, blob.codec_id, blob.dtype, blob.shape, blob.payload, blob.version)
        return [memoryview(self._head), memoryview(blob.payload).cast("B")]

    def fill(self, dst: memoryview) -> None:
        seal_into(dst, self.blob)
