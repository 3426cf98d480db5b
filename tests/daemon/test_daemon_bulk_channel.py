"""The daemon side of a bulk connection (kvstore/daemon/bulk_channel.py: ``Channel``) over a real
socket pair: what a reply frame holds (a pinned chunk, a pooled buffer) is released however
the frame ends, and closing never waits for a sender thread that is already done."""

import asyncio
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvstore.daemon.bulk_channel import SMALL_FRAME_BYTES, Channel
from kvstore.daemon.identity import DEFAULT
from kvstore.wire.frames import END


def channel(sock: socket.socket, senders: ThreadPoolExecutor) -> Channel:
    sock.setblocking(False)
    return Channel(sock, timeout_s=5.0, owner=DEFAULT, pin_ttl_s=30.0, max_pinned_bytes=1 << 20, senders=senders)


def test_a_small_frame_to_a_peer_that_left_still_releases_what_it_holds():
    """A small frame is written at once from the event loop. Before the fix a peer that had
    gone (EPIPE, ECONNRESET) made that write raise past ``then``: the pin or pooled buffer
    handed over with the frame was never released."""
    ours, theirs = socket.socketpair()
    theirs.close()
    released = []

    async def main():
        with ThreadPoolExecutor(1) as senders:
            ch = channel(ours, senders)
            with pytest.raises(ConnectionError):
                await ch.send(END, b"", b"x" * 100, then=lambda: released.append(True))
            await ch.close()

    asyncio.run(main())
    assert released == [True]


class _HeldSecondTime:
    """A lock whose second acquisition by the sender thread waits for ``go``: the thread has
    written its frame and is about to find the outbox empty."""

    def __init__(self, inner: threading.Lock, sender_prefix: str) -> None:
        self.inner, self.prefix = inner, sender_prefix
        self.seen = 0
        self.at_second, self.go = threading.Event(), threading.Event()

    def __enter__(self):
        if threading.current_thread().name.startswith(self.prefix):
            self.seen += 1
            if self.seen == 2:
                self.at_second.set()
                assert self.go.wait(10)
        self.inner.acquire()
        return self

    def __exit__(self, *exc):
        self.inner.release()


def test_close_after_the_last_frame_was_written_does_not_wait_forever():
    """The sender thread reports each frame written to the event loop, then finds the outbox
    empty and stops. Before the fix, a ``close`` that ran between the two waited for a wake-up
    that never came: the thread's stop was not reported."""
    ours, theirs = socket.socketpair()
    drained = threading.Thread(target=lambda: [None for _ in iter(lambda: theirs.recv(1 << 20), b"")])
    drained.start()

    async def main():
        with ThreadPoolExecutor(1, thread_name_prefix="bulk-test-sender") as senders:
            ch = channel(ours, senders)
            held = ch._lock = _HeldSecondTime(ch._lock, "bulk-test-sender")
            await ch.send(END, b"", b"x" * (2 * SMALL_FRAME_BYTES))  # big: the sender thread writes it
            assert await asyncio.to_thread(held.at_second.wait, 10)
            while ch._queued_bytes:  # the loop has run the frame's report
                await asyncio.sleep(0.01)
            closing = asyncio.ensure_future(ch.close())
            await asyncio.sleep(0.05)  # close is waiting for the sender thread now
            held.go.set()
            await asyncio.wait({closing}, timeout=5)
            assert closing.done(), "close still waits for a sender thread that has stopped"
            await closing

    try:
        asyncio.run(main())
    finally:
        theirs.close()
        drained.join(5)
