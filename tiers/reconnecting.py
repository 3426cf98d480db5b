"""A tier whose medium may be down when the store starts (e.g. Redis): it is built on
first use and, while that fails, retried at most every ``retry_s`` seconds.

Until the medium is reached, reads and writes raise ``TierUnavailable`` (the store counts
the error and uses other replicas) and the tier looks empty, whether it is down or refuses
us (a wrong password); at start, though, a refusal is a configuration error, and raised.
Once built, the inner tier handles later outages itself. Once closed, it is never built
again: a call after ``close`` connecting would open a connection nobody closes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterator, Sequence

from tiers.base import Buffer, Tier, TierError, TierUnavailable

log = logging.getLogger(__name__)


class ReconnectingTier(Tier):
    def __init__(self, name: str, capacity_bytes: int, factory: Callable[[], Tier], shared: bool, retry_s: float = 5.0) -> None:
        super().__init__(name, capacity_bytes)
        self.shared = shared
        self._factory = factory
        self._retry_s = retry_s
        self._inner: Tier | None = None
        self._next_try = 0.0
        self._closed = False
        self._lock = threading.Lock()  # held while building, so a close waits for a build under way
        self._connect(TierUnavailable)

    def connect(self) -> Tier | None:
        """The inner tier, building it now if it is not built, not closed and a retry is due."""
        return self._connect(TierError)

    def _connect(self, retried: type[TierError]) -> Tier | None:
        """``connect``, where a build failing with ``retried`` is logged and tried again later.
        At start that is only a medium that is down: one that refuses us (a wrong password, a
        missing permission) is a configuration error, raised naming the tier. Later, any tier
        error is this tier failing, for the store to count, never the caller's exception."""
        inner = self._inner
        if inner is not None:
            return inner
        with self._lock:
            if self._inner is None and not self._closed and time.monotonic() >= self._next_try:
                try:
                    self._inner = self._factory()
                    log.info("%s: connected", self.name)
                except retried as exc:
                    self._next_try = time.monotonic() + self._retry_s
                    log.warning("%s: unavailable, retrying every %.0f s: %s", self.name, self._retry_s, exc)
                except TierError as exc:
                    raise TierError(f"{self.name}: {exc}") from exc
            return self._inner

    def _require(self) -> Tier:
        inner = self.connect()
        if inner is None:
            raise TierUnavailable(f"{self.name}: {'closed' if self._closed else 'not connected'}")
        return inner

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        self._require().write(key, parts)

    def read(self, key: bytes):
        return self._require().read(key)

    def read_into(self, key: bytes, out) -> int | None:
        return self._require().read_into(key, out)

    def peek(self, key: bytes, nbytes: int) -> bytes | None:
        return self._require().peek(key, nbytes)

    def sync(self, key: bytes) -> None:
        self._require().sync(key)

    def delete(self, key: bytes) -> bool:
        return self._require().delete(key)

    def contains(self, key: bytes) -> bool:
        inner = self.connect()
        return inner is not None and inner.contains(key)

    def size_of(self, key: bytes) -> int | None:
        inner = self.connect()
        return None if inner is None else inner.size_of(key)

    def keys(self) -> Iterator[bytes]:
        inner = self.connect()
        return iter(()) if inner is None else inner.keys()

    @property
    def used_bytes(self) -> int:
        return 0 if self._inner is None else self._inner.used_bytes

    def footprint(self, nbytes: int) -> int:
        return nbytes if self._inner is None else self._inner.footprint(nbytes)

    def __len__(self) -> int:
        return 0 if self._inner is None else len(self._inner)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            inner, self._inner = self._inner, None
        if inner is not None:
            inner.close()
