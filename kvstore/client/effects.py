"""What the client core asks its front to do: every piece of I/O, as a plain record.

The core (kvstore/client/core.py) is written once, as generators that yield these records
and receive their results; the sync front performs them blocking, the async front awaits
them. An effect that fails raises its error back into the generator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Rpc:
    """A unary (or client-streaming) call of ``method``; the reply. ``health``: the health service."""

    method: str
    request: Any
    health: bool = False


@dataclass(frozen=True)
class OpenGet:
    """Start a Get stream; a handle for ``NextReply`` and ``CancelGet``."""

    request: Any


@dataclass(frozen=True)
class NextReply:
    """The stream's next GetReply, or None at its end."""

    stream: Any


@dataclass(frozen=True)
class CancelGet:
    stream: Any


@dataclass(frozen=True)
class Connect:
    """A TCP connection to ``host:port``, tuned for bulk transfers."""

    host: str
    port: int


@dataclass(frozen=True)
class Send:
    """Send ``parts`` back to back."""

    sock: Any
    parts: Sequence


@dataclass(frozen=True)
class RecvInto:
    """Fill ``view`` exactly (ConnectionError if the peer closes first)."""

    sock: Any
    view: memoryview


@dataclass(frozen=True)
class Close:
    sock: Any


@dataclass(frozen=True)
class Copy:
    """``fn(*args)``: a multi-MiB copy, which the async front runs off its event loop (and
    waits for, even when cancelled: it writes into the caller's memory)."""

    fn: Callable
    args: tuple


@dataclass(frozen=True)
class Sleep:
    seconds: float


@dataclass(frozen=True)
class CallsDone:
    """Wait until no call of the client runs any more (``close``; the core's
    ``wait_calls_done``). The async front waits in a thread: those calls run on its loop."""
