"""``AsyncClient``: the asyncio front of the client core, on grpc.aio. Bulk frames move on the
event loop (non-blocking sockets); copies into and out of shared-memory slots run in a small
thread pool so the loop never waits on a multi-MiB memcpy. Create it inside the event loop
that uses it."""

from __future__ import annotations

import asyncio
import functools
import socket
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.core import ClientCore, channel_for
from kvstore.client.effects import (CallsDone, CancelGet, Close, Connect, Copy, NextReply, OpenGet, RecvInto, Rpc,
                                    Send, Sleep)
from kvstore.client.errors import DaemonError
from kvstore.client.options import ClientOptions
from kvstore.wire.fence import fenced


class _Awaiting:
    """Performs effects on the event loop: gRPC calls with the client's deadline, socket
    operations under it as a timeout, copies in threads."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core
        self.timeout_s, self.metadata = core.options.timeout_s, core.metadata
        self.buffer_bytes = core.options.socket_buffer_bytes
        self.channel = channel_for(core, grpc.aio)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.copies = ThreadPoolExecutor(core.options.copy_threads, thread_name_prefix="kvstore-copy")
        self.perform = {Rpc: self._rpc, OpenGet: self._open, NextReply: self._next, CancelGet: self._cancel,
                        Connect: self._connect, Send: self._send, RecvInto: self._recv_into, Close: self._close,
                        Copy: self._copy, Sleep: self._sleep, CallsDone: self._calls_done}

    async def _rpc(self, e: Rpc):
        try:
            return await getattr(self.health if e.health else self.stub, e.method)(
                e.request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None

    async def _open(self, e: OpenGet):
        return self.stub.Get(e.request, timeout=self.timeout_s, metadata=self.metadata)

    @staticmethod
    async def _next(e: NextReply):
        try:
            reply = await e.stream.read()
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None
        return None if reply is grpc.aio.EOF else reply

    @staticmethod
    async def _cancel(e: CancelGet) -> None:
        e.stream.cancel()

    async def _connect(self, e: Connect) -> socket.socket:
        """Each address the host resolves to, in order, until one connects (as the blocking
        front's ``socket.create_connection``): "localhost" is often ::1 first, and a daemon
        listening on 127.0.0.1 only is then reached at its second address."""
        loop = asyncio.get_running_loop()
        error: OSError | None = None
        for family, kind, proto, _, address in await loop.getaddrinfo(e.host, e.port, type=socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                    sock.setsockopt(socket.SOL_SOCKET, opt, self.buffer_bytes)
                async with asyncio.timeout(self.timeout_s):
                    await loop.sock_connect(sock, address)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error if error is not None else OSError(f"{e.host} resolves to no address")

    async def _send(self, e: Send) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(self.timeout_s):
            for part in e.parts:
                await loop.sock_sendall(e.sock, part)

    async def _recv_into(self, e: RecvInto) -> None:
        loop = asyncio.get_running_loop()
        view, got = e.view, 0
        async with asyncio.timeout(self.timeout_s):
            while got < view.nbytes:
                n = await loop.sock_recv_into(e.sock, view[got:])
                if n == 0:
                    raise ConnectionError("the daemon closed the bulk connection")
                got += n

    @staticmethod
    async def _close(e: Close) -> None:
        e.sock.close()

    async def _copy(self, e: Copy):
        """The copy in a thread; if we are cancelled meanwhile, the thread still writes into
        the caller's memory: it is waited for before the cancellation goes through."""
        return await fenced(asyncio.get_running_loop().run_in_executor(self.copies, e.fn, *e.args))

    @staticmethod
    async def _sleep(e: Sleep) -> None:
        await asyncio.sleep(e.seconds)

    async def _calls_done(self, e: CallsDone) -> None:
        await asyncio.to_thread(self.core.wait_calls_done)


def _awaitable(op):
    @functools.wraps(op)
    async def method(self, *args, **kwargs):
        return await self._drive(self._core.call(op(self._core, *args, **kwargs)))

    return method


class AsyncClient:
    """The asyncio client: ``Client``'s methods, awaitable. ``options`` and keyword overrides
    are ``ClientOptions`` fields."""

    def __init__(self, addr: str = "127.0.0.1:50051", options: ClientOptions | None = None, **overrides) -> None:
        self.addr = addr
        self._core = ClientCore(addr, ClientOptions.merged(options, overrides))
        self._io = _Awaiting(self._core)
        self._closed: asyncio.Task | None = None  # the first close()'s work, which every close awaits

    @property
    def options(self) -> ClientOptions:
        return self._core.options

    async def _drive(self, op):
        """Run a core operation to its end, awaiting each effect it yields."""
        value, error = None, None
        while True:
            try:
                effect = op.send(value) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = await self._io.perform[type(effect)](effect), None
            except BaseException as exc:
                value, error = None, exc

    put = _awaitable(ClientCore.put)
    put_blob = _awaitable(ClientCore.put_blob)
    get_into = _awaitable(ClientCore.get_into)
    get = _awaitable(ClientCore.get)
    get_many_into = _awaitable(ClientCore.get_many_into)
    get_blob = _awaitable(ClientCore.get_blob)
    lookup = _awaitable(ClientCore.lookup)
    contains = _awaitable(ClientCore.contains)
    pin = _awaitable(ClientCore.pin)
    pin_leading = _awaitable(ClientCore.pin_leading)
    unpin = _awaitable(ClientCore.unpin)
    prefetch = _awaitable(ClientCore.prefetch)
    pause = _awaitable(ClientCore.pause)
    resume_soon = _awaitable(ClientCore.resume_soon)
    delete = _awaitable(ClientCore.delete)
    stats = _awaitable(ClientCore.stats)
    stats_reply = _awaitable(ClientCore.stats_reply)
    config = _awaitable(ClientCore.config)
    ping = _awaitable(ClientCore.ping)
    path = _awaitable(ClientCore.path)

    async def flush(self) -> None:
        """Nothing is buffered client-side: every acknowledged put is in the daemon."""

    async def close(self) -> None:
        """Refuse new calls (DaemonError CANCELLED), wait for the calls other tasks have in
        flight, then give the lease and the bulk sessions back and close the channel. That
        runs in a task of its own: a close that is cancelled (``wait_for``, a cancelled task)
        still gives everything back, and a later close returns once it has."""
        if self._closed is None:
            self._closed = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._closed)

    async def _close(self) -> None:
        try:
            await self._drive(self._core.close())
        finally:
            await self._io.channel.close()
            self._io.copies.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
