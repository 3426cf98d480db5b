"""The client's side of a bulk channel (kvstore/wire/frames.py), as core generators: one
attached connection, one request at a time."""

from __future__ import annotations

from typing import Sequence

from google.protobuf.message import DecodeError

from kvstore.wire._proto import kvstore_pb2 as pb
from kvstore.client.effects import Close, Connect, RecvInto, Send
from kvstore.client.errors import DaemonError, status
from kvstore.wire.frames import CHUNK, DONE, END, ERROR, FRAME, HELLO, MAX_META_BYTES


class BulkSession:
    def __init__(self, sock, reply: pb.BulkAttachReply) -> None:
        self.sock = sock
        self.max_frame_bytes = reply.max_frame_bytes
        self.pin_ttl_s = reply.pin_ttl_s or float("inf")
        self.max_pinned_bytes = reply.max_pinned_bytes  # one Get's pool views at most (0: unbounded)

    @classmethod
    def open(cls, host: str, reply: pb.BulkAttachReply):
        sock = yield Connect(host, reply.port)
        try:
            yield Send(sock, [HELLO.pack(reply.session, reply.token)])
            ack = bytearray(1)
            yield RecvInto(sock, memoryview(ack))
            if ack != b"\x01":
                raise ConnectionError("the daemon refused the bulk connection")
        except BaseException:
            yield Close(sock)
            raise
        return cls(sock, reply)

    def send(self, kind: int, meta: bytes = b"", views: Sequence[memoryview] = ()):
        yield Send(self.sock, [FRAME.pack(kind, len(meta), sum(v.nbytes for v in views)) + meta, *views])

    def reply(self):
        """The next reply frame's kind, meta and data length (receive the data next); an
        ERROR frame raises its DaemonError."""
        header = bytearray(FRAME.size)
        yield RecvInto(self.sock, memoryview(header))
        kind, meta_len, data_len = FRAME.unpack(header)
        if meta_len > MAX_META_BYTES:
            raise ConnectionError(f"bulk reply with {meta_len} bytes of meta")
        meta = bytearray(meta_len)
        if meta_len:
            yield RecvInto(self.sock, memoryview(meta))
        if kind == ERROR:
            try:
                error = pb.ErrorReply.FromString(bytes(meta))
            except DecodeError:
                raise ConnectionError("unreadable ERROR frame") from None
            raise DaemonError(status(error.code), error.message)
        if kind not in (CHUNK, END, DONE):
            raise ConnectionError(f"unknown bulk frame kind {kind}")
        return kind, bytes(meta), data_len

    def recv_into(self, view: memoryview):
        yield RecvInto(self.sock, view)

    def chunk(self, kind: int, meta: bytes) -> pb.GetReply:
        if kind != CHUNK:
            raise ConnectionError(f"bulk frame of kind {kind} inside a Get")
        try:
            return pb.GetReply.FromString(meta)
        except DecodeError:
            raise ConnectionError("unreadable CHUNK frame") from None

    def close(self):
        yield Close(self.sock)
