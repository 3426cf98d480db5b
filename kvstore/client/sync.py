"""``Client``: the blocking front of the client core. Each method runs the core's operation,
performing its effects in the calling thread; one client is safe to share between threads."""

from __future__ import annotations

import functools
import socket
import time

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvstore.wire._proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.core import ClientCore, channel_for
from kvstore.client.effects import (CallsDone, CancelGet, Close, Connect, Copy, NextReply, OpenGet, RecvInto, Rpc,
                                    Send, Sleep)
from kvstore.client.errors import DaemonError
from kvstore.client.options import ClientOptions


class _Blocking:
    """Performs effects, blocking: gRPC calls with the client's deadline, sockets with it as
    their timeout."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core
        self.timeout_s, self.metadata = core.options.timeout_s, core.metadata
        self.buffer_bytes = core.options.socket_buffer_bytes
        self.channel = channel_for(core, grpc)
        self.stub = pb_grpc.KVStoreStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.perform = {Rpc: self._rpc, OpenGet: self._open, NextReply: self._next, CancelGet: self._cancel,
                        Connect: self._connect, Send: self._send, RecvInto: self._recv_into, Close: self._close,
                        Copy: self._copy, Sleep: self._sleep, CallsDone: self._calls_done}

    def _rpc(self, e: Rpc):
        try:
            return getattr(self.health if e.health else self.stub, e.method)(
                e.request, timeout=self.timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None

    def _open(self, e: OpenGet):
        return self.stub.Get(e.request, timeout=self.timeout_s, metadata=self.metadata)

    @staticmethod
    def _next(e: NextReply):
        try:
            return next(e.stream, None)
        except grpc.RpcError as exc:
            raise DaemonError(exc.code(), exc.details() or "") from None

    @staticmethod
    def _cancel(e: CancelGet) -> None:
        e.stream.cancel()

    def _connect(self, e: Connect) -> socket.socket:
        sock = socket.create_connection((e.host, e.port), timeout=self.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, self.buffer_bytes)
        return sock

    @staticmethod
    def _send(e: Send) -> None:
        for part in e.parts:
            e.sock.sendall(part)

    @staticmethod
    def _recv_into(e: RecvInto) -> None:
        view, got = e.view, 0
        while got < view.nbytes:
            n = e.sock.recv_into(view[got:])
            if n == 0:
                raise ConnectionError("the daemon closed the bulk connection")
            got += n

    @staticmethod
    def _close(e: Close) -> None:
        e.sock.close()

    @staticmethod
    def _copy(e: Copy):
        return e.fn(*e.args)

    @staticmethod
    def _sleep(e: Sleep) -> None:
        time.sleep(e.seconds)

    def _calls_done(self, e: CallsDone) -> None:
        self.core.wait_calls_done()


def _blocking(op):
    @functools.wraps(op)
    def method(self, *args, **kwargs):
        return self._drive(self._core.call(op(self._core, *args, **kwargs)))

    return method


class Client:
    """A daemon client with the Store's methods (see kvstore/client/transports.py for how chunk
    bytes travel). ``options`` and keyword overrides are ``ClientOptions`` fields."""

    def __init__(self, addr: str = "127.0.0.1:50051", options: ClientOptions | None = None, **overrides) -> None:
        self.addr = addr
        self._core = ClientCore(addr, ClientOptions.merged(options, overrides))
        self._io = _Blocking(self._core)

    @property
    def options(self) -> ClientOptions:
        return self._core.options

    def _drive(self, op):
        """Run a core operation to its end, performing each effect it yields."""
        value, error = None, None
        while True:
            try:
                effect = op.send(value) if error is None else op.throw(error)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = self._io.perform[type(effect)](effect), None
            except BaseException as exc:
                value, error = None, exc

    put = _blocking(ClientCore.put)
    put_blob = _blocking(ClientCore.put_blob)
    get_into = _blocking(ClientCore.get_into)
    get = _blocking(ClientCore.get)
    get_many_into = _blocking(ClientCore.get_many_into)
    get_with = _blocking(ClientCore.get_with)
    get_blob = _blocking(ClientCore.get_blob)
    lookup = _blocking(ClientCore.lookup)
    contains = _blocking(ClientCore.contains)
    pin = _blocking(ClientCore.pin)
    pin_leading = _blocking(ClientCore.pin_leading)
    unpin = _blocking(ClientCore.unpin)
    prefetch = _blocking(ClientCore.prefetch)
    pause = _blocking(ClientCore.pause)
    resume_soon = _blocking(ClientCore.resume_soon)
    delete = _blocking(ClientCore.delete)
    stats = _blocking(ClientCore.stats)
    stats_reply = _blocking(ClientCore.stats_reply)
    config = _blocking(ClientCore.config)
    ping = _blocking(ClientCore.ping)

    @property
    def path(self) -> str:
        """The transport chunk bytes take now: "shm", "bulk" or "grpc"."""
        return self._drive(self._core.call(self._core.path()))

    def hands_over_in_place(self, device: torch.device | str = "cpu") -> bool:
        return self._core.hands_over_in_place(device)

    def flush(self) -> None:
        """Nothing is buffered client-side: every acknowledged put is in the daemon."""

    def close(self) -> None:
        """Refuse new calls (DaemonError CANCELLED), wait for the calls other threads have in
        flight, then give the lease and the bulk sessions back and close the channel. One
        interrupted (KeyboardInterrupt) leaves the channel open, so the next close finishes."""
        self._drive(self._core.close())
        self._io.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
