"""The bulk channel: Get and Put on plain TCP connections, for clients that attach one.

Python gRPC costs the daemon about half a millisecond of CPU per message and more per call
(measured with 4 KiB chunks: ~1 ms per chunk in all), as much as moving a 4 MiB chunk, and
copies every ``bytes`` payload several times. So a client that can reach the bulk port sends
its Gets and Puts there instead: the requests are the RPCs' own messages (GetRequest,
PutHeader), so validation, limits and errors are the same; chunk bytes follow their reply
as raw bytes, or stay in shared-memory slots. gRPC keeps everything else (leases, lookups,
stats, the attach itself) and serves Get/Put for clients without a channel (TLS, other
languages).

The frames and the attach handshake are in kvstore/wire/frames.py.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from kvstore.daemon.buffers import BufferPool
from kvstore.wire.frames import FRAME, HELLO, MAX_META_BYTES, RELEASE, REQUEST_KINDS, TOKEN_BYTES

log = logging.getLogger(__name__)

class BulkError(Exception):
    pass


@dataclass
class Session:
    session_id: int
    token: bytes
    issued: float
    sock: socket.socket | None = None


class Channel:
    """An attached connection, as the request handler sees it: it sends reply frames."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self.sock, self.timeout_s = sock, timeout_s
        self.held: list[Callable[[], object]] = []  # releases of chunks the client is copying

    def release(self) -> None:
        held, self.held = self.held, []
        for release in held:
            release()

    async def send(self, kind: int, meta: bytes = b"", data=None) -> None:
        """One frame; ``data`` is a buffer, a list of buffers (sent back to back), or None.
        A frame the peer has not taken within ``timeout_s`` cuts it off (ConnectionError): what
        a Get holds for it (pinned pages, buffers) must not stay held forever."""
        loop = asyncio.get_running_loop()
        parts = [] if data is None else data if isinstance(data, list) else [data]
        views = [memoryview(p).cast("B") for p in parts]
        try:
            async with asyncio.timeout(self.timeout_s):
                await loop.sock_sendall(self.sock, FRAME.pack(kind, len(meta), sum(v.nbytes for v in views)) + meta)
                for view in views:
                    if view.nbytes:
                        await loop.sock_sendall(self.sock, view)
        except TimeoutError:
            raise ConnectionError(f"the bulk peer read nothing for {self.timeout_s} s") from None

    async def send_file_ranges(self, kind: int, meta: bytes, file, runs: list[tuple[int, int]]) -> None:
        """One frame whose data is (offset, length) ranges of ``file``, sent with sendfile():
        the kernel takes the pages by reference, so they must stay unchanged until the peer
        has read them (the caller keeps them pinned until RELEASE)."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout_s):
                await loop.sock_sendall(self.sock, FRAME.pack(kind, len(meta), sum(n for _, n in runs)) + meta)
                for offset, length in runs:
                    await self._sendfile(file.fileno(), offset, length)
        except TimeoutError:
            raise ConnectionError(f"the bulk peer read nothing for {self.timeout_s} s") from None

    async def _sendfile(self, fd: int, offset: int, count: int) -> None:
        """sendfile() until done, waiting only when the socket is full. (The event loop's
        sock_sendfile takes an extra loop turn per call, and a chunk can be many ranges.)"""
        while count:
            try:
                sent = os.sendfile(self.sock.fileno(), fd, offset, count)
            except BlockingIOError:
                await self._writable()
                continue
            if sent == 0:
                raise ConnectionError("sendfile() sent nothing: the pool file is shorter than its pages")
            offset, count = offset + sent, count - sent

    async def _writable(self) -> None:
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        fd = self.sock.fileno()
        loop.add_writer(fd, lambda: ready.done() or ready.set_result(None))
        try:
            await ready
        finally:
            loop.remove_writer(fd)


# handler(channel, kind, meta, data): answer one request; data is a pool buffer or None and
# belongs to the handler (give it back to the pool)
Handler = Callable[[Channel, int, bytes, "np.ndarray | None"], Awaitable[None]]


class BulkServer:
    def __init__(self, host: str, port: int, max_sessions: int, max_frame_bytes: int,
                 frame_timeout_s: float, socket_buffer_bytes: int, pool: BufferPool) -> None:
        self.host, self.max_sessions, self.pool = host, max_sessions, pool
        self.max_frame_bytes, self.frame_timeout_s = max_frame_bytes, frame_timeout_s
        self.socket_buffer_bytes = socket_buffer_bytes
        self._sessions: dict[int, Session] = {}
        self._tasks: set[asyncio.Task] = set()
        self._idle: dict[asyncio.Task, socket.socket] = {}  # connections between requests
        self._closing = False
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(64)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accept_task: asyncio.Task | None = None
        self._handler: Handler | None = None

    @property
    def sessions(self) -> int:
        return sum(1 for s in self._sessions.values() if s.sock is not None)

    def start(self, handler: Handler) -> None:
        self._handler = handler
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

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            conn, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._idle.pop(task, None)

    @staticmethod
    async def _recv_exactly(sock: socket.socket, buf) -> None:
        loop = asyncio.get_running_loop()
        view, got = memoryview(buf).cast("B"), 0
        while got < view.nbytes:
            n = await loop.sock_recv_into(sock, view[got:])
            if n == 0:
                raise ConnectionError("bulk peer closed the connection")
            got += n

    async def _attach(self, conn: socket.socket) -> Session | None:
        hello = bytearray(HELLO.size)
        await asyncio.wait_for(self._recv_exactly(conn, hello), self.frame_timeout_s)
        sid, token = HELLO.unpack(hello)
        session = self._sessions.get(sid)
        if session is None or session.sock is not None or not hmac.compare_digest(session.token, token):
            log.warning("bulk: rejected a connection with a bad session or token")
            return None
        session.sock = conn
        await asyncio.get_running_loop().sock_sendall(conn, b"\x01")
        return session

    async def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            conn.setsockopt(socket.SOL_SOCKET, opt, self.socket_buffer_bytes)
        session = None
        channel = Channel(conn, self.frame_timeout_s)
        try:
            session = await self._attach(conn)
            if session is None:
                return
            header = bytearray(FRAME.size)
            task = asyncio.current_task()
            while not self._closing:
                self._idle[task] = conn
                await self._recv_exactly(conn, header)  # an idle connection may wait forever
                del self._idle[task]
                kind, meta_len, data_len = FRAME.unpack(header)
                if kind not in REQUEST_KINDS or meta_len > MAX_META_BYTES or data_len > self.max_frame_bytes:
                    log.warning("bulk: bad frame (kind %d, meta %d B, data %d B); closing", kind, meta_len, data_len)
                    return
                meta = bytearray(meta_len)
                data = self.pool.take(data_len) if data_len else None
                try:
                    await asyncio.wait_for(self._recv_body(conn, meta, data), self.frame_timeout_s)
                except BaseException:
                    if data is not None:
                        self.pool.give(data)
                    raise
                channel.release()
                if kind != RELEASE:
                    await self._handler(channel, kind, bytes(meta), data)
                elif data is not None:
                    self.pool.give(data)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            channel.release()
            if session is not None:
                self._sessions.pop(session.session_id, None)
            conn.close()

    async def _recv_body(self, conn: socket.socket, meta: bytearray, data) -> None:
        if meta:
            await self._recv_exactly(conn, meta)
        if data is not None:
            await self._recv_exactly(conn, data)

    async def close(self, grace_s: float = 0.0) -> None:
        """Stop accepting; close idle connections; give requests in flight ``grace_s`` to
        finish (like the gRPC server's graceful stop), then cut them off."""
        self._closing = True
        if self._accept_task is not None:
            self._accept_task.cancel()
        self._listener.close()
        for conn in self._idle.values():
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        for t in list(self._tasks):
            t.cancel()
