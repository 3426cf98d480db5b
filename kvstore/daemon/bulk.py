"""The bulk side channel: chunk bytes over plain TCP connections, control over gRPC.

Python gRPC moves large payloads at a fraction of what a socket does (every message is
copied several times), so bulk data skips it. A client asks BulkAttach (an authenticated
RPC) for a session id and a one-time token, connects to the bulk port and sends
``session (8 bytes LE) + token (32 bytes)``; the daemon answers one byte (1 = attached) or
closes the connection. From then on the connection carries frames::

    op (8 bytes LE) | length (8 bytes LE) | length bytes

client -> daemon: a Put's blob, read into memory until the Put RPC naming (session, op)
takes it (one frame outstanding per session); daemon -> client: the chunks a Get RPC
asked for, each sent right after the Get's reply message for it. A client uses a session
for one operation at a time; any error closes the connection (the client opens a new one).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import socket
import struct
import time
from dataclasses import dataclass, field

import numpy as np

from kvstore.daemon.buffers import BufferPool

log = logging.getLogger(__name__)

FRAME = struct.Struct("<QQ")
HELLO = struct.Struct("<Q32s")
TOKEN_BYTES = 32


class BulkError(Exception):
    pass


@dataclass
class Session:
    session_id: int
    token: bytes
    issued: float
    sock: socket.socket | None = None
    frame: tuple[int, np.ndarray] | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    taken: asyncio.Event = field(default_factory=asyncio.Event)
    send_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False


class BulkServer:
    def __init__(self, host: str, port: int, max_sessions: int, max_frame_bytes: int,
                 frame_timeout_s: float, socket_buffer_bytes: int, pool: BufferPool) -> None:
        self.host, self.max_sessions, self.pool = host, max_sessions, pool
        self.max_frame_bytes, self.frame_timeout_s = max_frame_bytes, frame_timeout_s
        self.socket_buffer_bytes = socket_buffer_bytes
        self._sessions: dict[int, Session] = {}
        self._tasks: set[asyncio.Task] = set()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accept_task: asyncio.Task | None = None

    @property
    def sessions(self) -> int:
        return sum(1 for s in self._sessions.values() if s.sock is not None)

    def start(self) -> None:
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    def issue(self) -> Session:
        """A new, unattached session with a one-time token (answer to BulkAttach)."""
        self._drop_stale_tokens()
        if len(self._sessions) >= self.max_sessions:
            raise BulkError(f"{self.max_sessions} bulk sessions open; close some first")
        session = Session(secrets.randbits(63) or 1, secrets.token_bytes(TOKEN_BYTES), time.monotonic())
        self._sessions[session.session_id] = session
        return session

    def _drop_stale_tokens(self) -> None:
        now = time.monotonic()
        for sid, s in list(self._sessions.items()):
            if s.sock is None and now - s.issued > self.frame_timeout_s:
                del self._sessions[sid]

    def get(self, session_id: int) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.sock is None or session.closed:
            raise BulkError(f"bulk session {session_id} is not attached")
        return session

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _recv_exactly(self, sock: socket.socket, buf) -> None:
        loop = asyncio.get_running_loop()
        view, got = memoryview(buf), 0
        while got < len(view):
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise ConnectionError("bulk peer closed the connection")
            got += n

    async def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            conn.setsockopt(socket.SOL_SOCKET, opt, self.socket_buffer_bytes)
        session = None
        try:
            hello = bytearray(HELLO.size)
            await asyncio.wait_for(self._recv_exactly(conn, hello), self.frame_timeout_s)
            sid, token = HELLO.unpack(hello)
            session = self._sessions.get(sid)
            if session is None or session.sock is not None or not hmac.compare_digest(session.token, token):
                log.warning("bulk: rejected a connection with a bad session or token")
                session = None
                return
            session.sock = conn
            await asyncio.get_running_loop().sock_sendall(conn, b"\x01")
            header = bytearray(FRAME.size)
            while True:
                await self._recv_exactly(conn, header)
                op, length = FRAME.unpack(header)
                if length > self.max_frame_bytes:
                    log.warning("bulk: frame of %d bytes exceeds %d; closing", length, self.max_frame_bytes)
                    return
                buf = self.pool.take(length)
                await self._recv_exactly(conn, buf)
                session.frame = (op, buf)
                session.taken.clear()
                session.arrived.set()
                await session.taken.wait()
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            if session is not None:
                session.closed = True
                session.arrived.set()
                self._sessions.pop(session.session_id, None)
            conn.close()

    async def take_frame(self, session: Session, op: int) -> np.ndarray:
        """The frame the client sent for ``op`` (waits for it up to the frame timeout); give
        the buffer back to the pool when done with it."""
        try:
            await asyncio.wait_for(session.arrived.wait(), self.frame_timeout_s)
        except asyncio.TimeoutError:
            raise BulkError(f"bulk frame {op} did not arrive within {self.frame_timeout_s} s") from None
        if session.closed or session.frame is None:
            raise BulkError("bulk session closed before its frame arrived")
        got_op, buf = session.frame
        session.frame = None
        session.arrived.clear()
        session.taken.set()
        if got_op != op:
            self.pool.give(buf)
            raise BulkError(f"bulk frame is for op {got_op}, the request names op {op}")
        return buf

    async def send_frame(self, session: Session, op: int, data) -> None:
        loop = asyncio.get_running_loop()
        view = memoryview(data).cast("B")
        async with session.send_lock:
            await loop.sock_sendall(session.sock, FRAME.pack(op, view.nbytes))
            await loop.sock_sendall(session.sock, view)

    def close_session(self, session: Session) -> None:
        session.closed = True
        if session.sock is not None:
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    async def close(self) -> None:
        if self._accept_task is not None:
            self._accept_task.cancel()
        for s in list(self._sessions.values()):
            self.close_session(s)
        for t in list(self._tasks):
            t.cancel()
        self._listener.close()
