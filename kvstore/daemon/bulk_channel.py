"""The daemon's side of one attached bulk connection: reply frames out, and the pins of the
chunks its client is reading.

Replies are queued for a sender thread (at most ``OUTBOX_BYTES``), so the event loop never
blocks on a slow reader; a small frame with nothing queued is written from the loop at once.
Pins a client holds are released on RELEASE, or after ``pin_ttl_s``, and then the connection
is cut off. The accept loop and the attach handshake are in kvstore/daemon/bulk.py.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from kvstore.daemon.identity import Tenant
from kvstore.wire.frames import FRAME

log = logging.getLogger("kvstore.daemon.bulk")

OUTBOX_BYTES = 16 << 20  # reply bytes a channel queues for its sender thread at most
SMALL_FRAME_BYTES = 64 << 10  # written at once from the event loop when nothing is queued


class Channel:
    """An attached connection, as the request handler sees it: it sends reply frames and
    holds the pins of the chunks its client is reading."""

    def __init__(self, sock: socket.socket, timeout_s: float, owner: Tenant, pin_ttl_s: float,
                 max_pinned_bytes: int, senders: ThreadPoolExecutor) -> None:
        self.sock, self.timeout_s, self.owner, self._senders = sock, timeout_s, owner, senders
        self.pin_ttl_s, self.max_pinned_bytes = pin_ttl_s, max_pinned_bytes
        self._held: list[Callable[[], object]] = []
        self.pinned_bytes = 0
        self._expiry: asyncio.TimerHandle | None = None
        # frames queued for the sender thread: (write(deadline), bytes, then), in order
        self._outbox: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._writer: asyncio.Future | None = None  # the sender thread's run, while one runs
        self._queued_bytes = 0
        self._room, self._flushed = asyncio.Event(), asyncio.Event()
        self._broken: BaseException | None = None

    def can_pin(self, nbytes: int) -> bool:
        return self.pinned_bytes + nbytes <= self.max_pinned_bytes

    def hold(self, release: Callable[[], object], nbytes: int) -> None:
        """Keep a chunk's pin until RELEASE, or ``pin_ttl_s`` from the first pin held."""
        self._held.append(release)
        self.pinned_bytes += nbytes
        if self._expiry is None:
            self._expiry = asyncio.get_running_loop().call_later(self.pin_ttl_s, self._expire)

    def release(self) -> None:
        held, self._held, self.pinned_bytes = self._held, [], 0
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        for release in held:
            release()

    def _expire(self) -> None:
        self._expiry = None
        log.info("bulk: a client held %d pinned chunks for %.0f s without RELEASE; releasing them and "
                 "closing its connection", len(self._held), self.pin_ttl_s)
        self.release()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # the serve loop sees the end and cleans up
        except OSError:
            pass

    async def send(self, kind: int, meta: bytes = b"", data=None, then: Callable[[], object] | None = None) -> None:
        """Queue one frame; ``data`` is a buffer, a list of buffers (sent back to back), or
        None. The frame's memory is in use until it is written: ``then`` (on the event loop)
        runs after that, or once it is abandoned (a broken connection)."""
        parts = [] if data is None else data if isinstance(data, list) else [data]
        views = [memoryview(p).cast("B") for p in parts]
        nbytes = sum(v.nbytes for v in views)
        views.insert(0, memoryview(FRAME.pack(kind, len(meta), nbytes) + meta))
        if nbytes < SMALL_FRAME_BYTES and self._writer is None and self._broken is None:
            try:
                views = self._write_now(views)  # nothing queued before it: no thread hop for a small frame
            except OSError as exc:  # the peer is gone: what the frame holds is released all the same
                self._broken = exc
                if then is not None:
                    then()
                raise ConnectionError(f"the bulk connection broke: {exc}") from exc
            if not views:
                if then is not None:
                    then()
                return
        await self._post(functools.partial(self._write_all, views), nbytes, then)

    async def _post(self, write, nbytes: int, then) -> None:
        """Put a frame in the outbox, started by a sender thread if none runs; wait while
        more than OUTBOX_BYTES are queued. The thread writes frame after frame without coming
        back to the event loop (a turn per frame left the socket idle between chunks), and
        waits for socket room in poll(), far more cheaply than an event-loop turn per wake-up.
        A frame the peer has not taken within ``timeout_s`` cuts the connection off: what a
        Get holds for it must not stay held forever."""
        if self._broken is not None:
            if then is not None:
                then()
            raise ConnectionError(f"the bulk connection broke: {self._broken}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while self._queued_bytes and self._queued_bytes + nbytes > OUTBOX_BYTES:
            self._room.clear()
            try:
                async with asyncio.timeout_at(deadline):
                    await self._room.wait()
            except TimeoutError:
                if then is not None:
                    then()
                raise ConnectionError(f"the bulk peer read nothing for {self.timeout_s} s") from None
            if self._broken is not None:
                if then is not None:
                    then()
                raise ConnectionError(f"the bulk connection broke: {self._broken}")
        self._queued_bytes += nbytes
        with self._lock:
            self._outbox.append((write, nbytes, then))
            start = self._writer is None
            if start:
                self._writer = loop.run_in_executor(self._senders, self._drain, loop)

    def _drain(self, loop: asyncio.AbstractEventLoop) -> None:
        """The sender thread: write queued frames in order until the outbox is empty."""
        while True:
            with self._lock:
                if not self._outbox:
                    self._writer = None
                    # flush() and close() wait for this too: the last _written may have run first
                    loop.call_soon_threadsafe(self._flushed.set)
                    return
                write, nbytes, then = self._outbox.popleft()
            if self._broken is None:
                try:
                    write(time.monotonic() + self.timeout_s)
                except OSError as exc:
                    self._broken = exc
                    try:
                        self.sock.shutdown(socket.SHUT_RDWR)  # the serve loop sees the end too
                    except OSError:
                        pass
            loop.call_soon_threadsafe(self._written, nbytes, then)

    def _written(self, nbytes: int, then) -> None:
        self._queued_bytes -= nbytes
        self._room.set()
        if then is not None:
            then()
        if self._queued_bytes == 0:
            self._flushed.set()

    async def flush(self) -> None:
        """Wait until every queued frame is written (ConnectionError if the connection broke)."""
        while self._queued_bytes or self._writer is not None:
            self._flushed.clear()
            await self._flushed.wait()
        if self._broken is not None:
            raise ConnectionError(f"the bulk connection broke: {self._broken}")

    async def close(self) -> None:
        """End the connection once no sender thread uses its socket any more."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        while self._queued_bytes or self._writer is not None:
            self._flushed.clear()
            try:
                await self._flushed.wait()
            except asyncio.CancelledError:
                continue  # the socket must not close under the thread
        self.sock.close()

    def _wait_writable(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        poll = select.poll()
        poll.register(self.sock, select.POLLOUT)
        if left <= 0 or not poll.poll(left * 1000):
            raise ConnectionError(f"the bulk peer read nothing for {self.timeout_s} s")
        if self._broken is not None:
            raise ConnectionError("the bulk connection was closed")

    def _write_all(self, views: list[memoryview], deadline: float) -> None:
        """All of ``views``, in as few system calls as the socket's room allows (sendmsg)."""
        while views := self._write_now(views):
            self._wait_writable(deadline)

    def _write_now(self, views: list[memoryview]) -> list[memoryview]:
        """Write what the socket takes now; the views still to write."""
        views = [v for v in views if v.nbytes]
        while views:
            try:
                sent = self.sock.sendmsg(views[:1024])
            except BlockingIOError:
                return views
            while views and sent >= views[0].nbytes:
                sent -= views[0].nbytes
                views.pop(0)
            if sent:
                views[0] = views[0][sent:]
        return views
