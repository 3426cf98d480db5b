"""The bulk channel: Get and Put on plain TCP connections, for clients that attach one.

Python gRPC costs the daemon about half a millisecond of CPU per message and more per call
(measured with 4 KiB chunks: ~1 ms per chunk in all), as much as moving a 4 MiB chunk, and
copies every ``bytes`` payload several times. So a client that can reach the bulk port sends
its Gets and Puts there instead: the requests are the RPCs' own messages (GetRequest,
PutHeader), so validation, limits and errors are the same; chunk bytes follow their reply
as raw bytes, or stay in shared-memory slots. gRPC keeps everything else (leases, lookups,
stats, the attach itself) and serves Get/Put for clients without a channel (TLS, other
languages). The frames and the attach handshake are in kvstore/wire/frames.py; this module
accepts and attaches connections and reads their requests, and an attached connection's
replies and pins are kvstore/daemon/bulk_channel.py's ``Channel``.

Floods and dead peers: the accept loop survives every accept() error (out of descriptors:
it backs off and logs); a connection that has not presented its session token is one of at
most ``max_unauthenticated`` (newer ones are closed at once) and has ``hello_timeout_s`` to
do so; attached connections use TCP keepalive, so a peer that vanished without a FIN is
noticed. Host-pool pages a Get pins for a client that copies them out itself (pool views)
stay pinned until RELEASE, the next request or the connection's end, and at most
``pin_ttl_s``: then they are released and the connection is cut off (a client that reads a
Get's data later than that must discard it: ``BulkAttachReply.pin_ttl_s``). Chunk bytes the
daemon sends are copied into the socket (never sendfile()d by reference: pages released to
other chunks while a socket still referenced them would reach a client that stopped reading
or released early).
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import logging
import secrets
import socket
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from kvstore.daemon.buffers import BufferPool
from kvstore.daemon.bulk_channel import Channel
from kvstore.daemon.config import BulkConfig
from kvstore.daemon.identity import Tenant
from kvstore.wire.frames import FRAME, HELLO, MAX_META_BYTES, RELEASE, REQUEST_KINDS, TOKEN_BYTES

log = logging.getLogger(__name__)

# accept() errors that mean "out of something, for now": back off instead of spinning
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class BulkError(Exception):
    pass


@dataclass
class Session:
    session_id: int
    token: bytes
    issued: float
    owner: Tenant
    sock: socket.socket | None = None


class _Every:
    """Log a recurring condition at most once per ``period_s``, with how often it happened."""

    def __init__(self, period_s: float = 10.0) -> None:
        self.period_s, self._last, self._count = period_s, 0.0, 0

    def __call__(self, message: str, *args) -> None:
        self._count += 1
        now = time.monotonic()
        if now - self._last >= self.period_s:
            log.warning(message + " (%d times since the last such message)", *args, self._count)
            self._last, self._count = now, 0


# handler(channel, kind, meta, data, refused): answer one request; data is a pool buffer or
# None and belongs to the handler (give it back to the pool). ``refused``: the error ``admit``
# raised for the frame, to answer with (no meta nor data then: its body is dropped after).
Handler = Callable[[Channel, int, bytes, "np.ndarray | None", "Exception | None"], Awaitable[None]]
# admit(owner, meta_bytes, data_bytes): a context manager holding what a frame announced
# against its tenant's and the daemon's limits while the request runs; raises if refused.
Admit = Callable[[Tenant, int, int], AbstractContextManager]
DISCARD_BYTES = 64 << 10  # the scratch a refused frame's body is read into and dropped


class BulkServer:
    def __init__(self, host: str, config: BulkConfig, max_frame_bytes: int, pool: BufferPool) -> None:
        self.host, self.config, self.pool = host, config, pool
        self.max_frame_bytes, self.frame_timeout_s = max_frame_bytes, config.frame_timeout_s
        self._sessions: dict[int, Session] = {}
        self._tasks: set[asyncio.Task] = set()
        self._conns: dict[asyncio.Task, socket.socket] = {}
        self._idle: dict[asyncio.Task, socket.socket] = {}  # connections between requests
        # threads that write reply frames with chunk bytes (a channel sends one frame at a time)
        self._senders = ThreadPoolExecutor(max(1, config.max_sessions), thread_name_prefix="bulk-send")
        self._closing = False
        # pins of channels cut while closing: kept until release_pins(), once nothing writes
        # into the host pool any more (in-flight requests go on writing during the grace period)
        self._kept: list[Channel] = []
        self.unauthenticated = 0
        self.refused = 0  # connections closed at once: too many unauthenticated ones
        self._warn_accept, self._warn_refused = _Every(), _Every()
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, config.port))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._accept_task: asyncio.Task | None = None
        self._handler: Handler | None = None
        self._admit: Admit | None = None

    @property
    def sessions(self) -> int:
        return sum(1 for s in self._sessions.values() if s.sock is not None)

    def start(self, handler: Handler, admit: Admit) -> None:
        self._handler, self._admit = handler, admit
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_loop())

    def issue(self, owner: Tenant) -> Session:
        """A new, unattached session with a one-time token (answer to BulkAttach)."""
        self._drop_stale_tokens()
        if len(self._sessions) >= self.config.max_sessions:
            raise BulkError(f"{self.config.max_sessions} bulk sessions open; close some first")
        mine = Counter(s.owner.name for s in self._sessions.values())[owner.name]
        if mine >= self.config.max_sessions_per_tenant:
            raise BulkError(f"{mine} bulk sessions of this tenant open; close some first")
        session = Session(secrets.randbits(63) or 1, secrets.token_bytes(TOKEN_BYTES), time.monotonic(), owner)
        self._sessions[session.session_id] = session
        return session

    def _drop_stale_tokens(self) -> None:
        """A token not presented within 2 x hello_timeout_s of its issue is void."""
        now = time.monotonic()
        for sid, s in list(self._sessions.items()):
            if s.sock is None and now - s.issued > 2 * self.config.hello_timeout_s:
                del self._sessions[sid]

    async def _accept_loop(self) -> None:
        """Accept until closed, whatever accept() says: out of descriptors (EMFILE, ENFILE)
        or buffers, back off (10 ms doubling to 1 s) and try again; a connection that died
        in the backlog (ECONNABORTED, ...) is skipped."""
        loop = asyncio.get_running_loop()
        backoff = 0.0
        while not self._closing:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                if self._closing:
                    return
                if exc.errno in _EXHAUSTED:
                    backoff = min(1.0, max(0.01, backoff * 2))
                    self._warn_accept("bulk: accept() failed: %s; retrying in %.2f s", exc.strerror, backoff)
                    await asyncio.sleep(backoff)
                continue
            backoff = 0.0
            if self.unauthenticated >= self.config.max_unauthenticated:
                self.refused += 1
                self._warn_refused("bulk: %d connections have not presented a token yet; closing a new one",
                                   self.unauthenticated)
                conn.close()
                continue
            self.unauthenticated += 1
            task = loop.create_task(self._serve(conn))
            self._tasks.add(task)
            self._conns[task] = conn
            task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        self._conns.pop(task, None)
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
        await asyncio.wait_for(self._recv_exactly(conn, hello), self.config.hello_timeout_s)
        sid, token = HELLO.unpack(hello)
        session = self._sessions.get(sid)
        if session is None or session.sock is not None or not hmac.compare_digest(session.token, token):
            log.debug("bulk: rejected a connection with a bad session or token")
            return None
        session.sock = conn
        await asyncio.get_running_loop().sock_sendall(conn, b"\x01")
        return session

    def _tune(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            conn.setsockopt(socket.SOL_SOCKET, opt, self.config.socket_buffer_bytes)
        idle, interval = self.config.keepalive_idle_s, self.config.keepalive_interval_s
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, interval)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        # unacknowledged data (a peer gone mid-transfer) ends the connection as soon, too
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, (idle + 3 * interval) * 1000)

    async def _serve(self, conn: socket.socket) -> None:
        session = None
        channel = None
        try:
            try:
                self._tune(conn)
                session = await self._attach(conn)
            finally:
                self.unauthenticated -= 1
            if session is None:
                return
            channel = Channel(conn, self.frame_timeout_s, session.owner, self.config.pin_ttl_s,
                              self.config.max_pinned_bytes, self._senders)
            header = bytearray(FRAME.size)
            task = asyncio.current_task()
            while not self._closing:
                self._idle[task] = conn
                await self._recv_exactly(conn, header)  # an idle connection may wait (keepalive watches it)
                del self._idle[task]
                kind, meta_len, data_len = FRAME.unpack(header)
                if (kind not in REQUEST_KINDS or meta_len > MAX_META_BYTES or data_len > self.max_frame_bytes
                        or kind == RELEASE and (meta_len or data_len)):
                    log.warning("bulk: bad frame (kind %d, meta %d B, data %d B); closing", kind, meta_len, data_len)
                    return
                channel.release()
                if kind != RELEASE:
                    await self._request(conn, channel, kind, meta_len, data_len)
        except (ConnectionError, OSError, asyncio.TimeoutError):
            pass
        finally:
            if channel is not None:
                if self._closing and channel.pinned_bytes:
                    self._kept.append(channel)  # its client may still be copying out of those pages
                else:
                    channel.release()
            if session is not None:
                self._sessions.pop(session.session_id, None)
            if channel is not None:
                await channel.close()
            else:
                conn.close()

    async def _request(self, conn: socket.socket, channel: Channel, kind: int, meta_len: int, data_len: int) -> None:
        """Admit a request frame by the sizes it announced, before any buffer is taken for
        its body: before, a PUT's body was received whole into a buffer of its size and only
        then checked against the tenant's in-flight bytes, so sessions withholding their
        last byte held gigabytes. A refused frame is answered at once, and its body is read
        into a small scratch buffer and dropped (the connection stays usable)."""
        with ExitStack() as held:
            try:
                held.enter_context(self._admit(channel.owner, meta_len, data_len))
            except Exception as refused:  # a status for the client (the handler answers it)
                await self._handler(channel, kind, b"", None, refused)
                async with asyncio.timeout(self.frame_timeout_s):
                    await self._discard(conn, meta_len + data_len)
                return
            meta = bytearray(meta_len)
            data = self.pool.take(data_len) if data_len else None
            try:
                async with asyncio.timeout(self.frame_timeout_s):  # in this task: wait_for would start a task a frame
                    await self._recv_body(conn, meta, data)
            except BaseException:
                if data is not None:
                    self.pool.give(data)
                raise
            await self._handler(channel, kind, bytes(meta), data, None)

    async def _discard(self, conn: socket.socket, nbytes: int) -> None:
        scratch = bytearray(min(nbytes, DISCARD_BYTES))
        while nbytes:
            await self._recv_exactly(conn, memoryview(scratch)[: min(nbytes, len(scratch))])
            nbytes -= min(nbytes, len(scratch))

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
        self._shutdown(self._idle.values())
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=grace_s)
        self._shutdown(self._conns.values())  # a sender thread waiting for room gives up at once
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks))
        self._senders.shutdown(wait=False)

    def release_pins(self) -> None:
        """Release the pins of the channels ``close`` cut (call once no request writes into
        the host pool: their clients may have been copying out of those pages meanwhile)."""
        kept, self._kept = self._kept, []
        for channel in kept:
            channel.release()

    @staticmethod
    def _shutdown(conns) -> None:
        for conn in list(conns):
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
