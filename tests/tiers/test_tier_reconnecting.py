"""ReconnectingTier: a tier built on first use and retried while its medium is down."""

import logging
import threading

import pytest

from faults import Call, Gate, wait_until
from tiers.base import TierError, TierUnavailable
from tiers.host import HostTier
from tiers.reconnecting import ReconnectingTier
from tiers.wrapped import WrappedTier

PAGE = 4096
KEY = b"k" * 32


class Medium(WrappedTier):
    """A host tier that notes its close, standing for a connection."""

    closed = False

    def close(self) -> None:
        self.closed = True
        super().close()


class Factory:
    """Builds Media, after failing as a server down would ``down`` times, then as one that
    refuses us would ``refused`` times; each build may be held at ``gate``."""

    def __init__(self, down: int = 0, refused: int = 0, gate: Gate | None = None) -> None:
        self.down, self.refused, self.gate = down, refused, gate
        self.built: list[Medium] = []

    def __call__(self) -> Medium:
        if self.down:
            self.down -= 1
            raise TierUnavailable("server down (injected)")
        if self.refused:
            self.refused -= 1
            raise TierError("wrong password (injected)")
        if self.gate is not None:
            self.gate.pass_through(b"")
        self.built.append(Medium(HostTier(4 * PAGE, page_bytes=PAGE, prefault=False)))
        return self.built[-1]


class WatchedLock:
    """A lock that notes when a caller has to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.waited = threading.Event()

    def __enter__(self) -> None:
        if not self._lock.acquire(blocking=False):
            self.waited.set()
            self._lock.acquire()

    def __exit__(self, *exc) -> None:
        self._lock.release()


def assert_closed(tier: ReconnectingTier) -> None:
    for call in (lambda: tier.write(KEY, [b"v"]), lambda: tier.read(KEY), lambda: tier.read_into(KEY, bytearray(1)),
                 lambda: tier.peek(KEY, 1), lambda: tier.sync(KEY), lambda: tier.delete(KEY)):
        with pytest.raises(TierUnavailable, match="closed"):
            call()
    assert not tier.contains(KEY) and tier.size_of(KEY) is None and list(tier.keys()) == []


@pytest.mark.parametrize("built", [False, True])
def test_after_close_no_call_connects(built):
    """Closed before its medium was ever reached, a call still built the tier: a connection
    nobody would close. Closed after, calls went on to the closed inner tier."""
    factory = Factory(down=0 if built else 1)
    tier = ReconnectingTier("r", 4 * PAGE, factory, shared=True, retry_s=0)
    assert len(factory.built) == int(built)
    tier.close()
    assert all(m.closed for m in factory.built)
    assert_closed(tier)
    assert len(factory.built) == int(built)
    tier.close()  # twice is harmless


def test_a_close_racing_a_build_closes_what_was_built():
    factory = Factory(down=1, gate=Gate())
    tier = ReconnectingTier("r", 4 * PAGE, factory, shared=True, retry_s=0)
    tier._lock = lock = WatchedLock()
    writer = Call(lambda: tier.write(KEY, [b"v"]))
    assert factory.gate.entered.wait(5)  # the writer is building the tier
    closer = Call(tier.close)
    wait_until(lambda: lock.waited.is_set() or closer.finished.is_set(), 5, "the close to wait or end")
    assert not closer.finished.is_set(), "close returned while a build was under way"
    factory.gate.open()
    closer.outcome()
    try:
        writer.outcome()  # the write ran before the close, or found the tier closed
    except TierUnavailable as exc:
        assert "closed" in str(exc)
    assert len(factory.built) == 1 and factory.built[0].closed
    assert_closed(tier)
    assert len(factory.built) == 1


def test_a_refusal_at_start_is_raised_naming_the_tier():
    with pytest.raises(TierError, match="^r: wrong password") as raised:
        ReconnectingTier("r", 4 * PAGE, Factory(refused=1), shared=True, retry_s=0)
    assert not isinstance(raised.value, TierUnavailable)


def test_a_refusal_later_is_this_tier_failing_logged_and_retried(caplog):
    """A medium down at start, then refusing us (the server came back with other
    credentials): the factory's error escaped from every call, into the store's threads."""
    factory = Factory(down=1, refused=1)
    tier = ReconnectingTier("r", 4 * PAGE, factory, shared=True, retry_s=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tiers.reconnecting"):
        with pytest.raises(TierUnavailable, match="not connected"):
            tier.write(KEY, [b"v"])
    assert [r.getMessage() for r in caplog.records] == [
        "r: unavailable, retrying every 0 s: wrong password (injected)"]
    tier.write(KEY, [b"v"])  # the next try succeeds
    assert tier.read(KEY) == b"v" and len(factory.built) == 1
    tier.close()
