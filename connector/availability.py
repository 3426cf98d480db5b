"""Whether the store is usable now. A store call that fails (the daemon died, the Store was
closed, a tier's device failed) turns the connector off for a back-off period, with one log
line per outage: meanwhile requests simply compute everything, as without a store, and the
engine never sees the error. The first call after the back-off tries the store again."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

log = logging.getLogger("connector")


class Availability:
    def __init__(self, backoff_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.backoff_s = backoff_s
        self._clock = clock
        self._lock = threading.Lock()
        self._off_until = 0.0
        self.outages = 0

    def available(self) -> bool:
        return self._clock() >= self._off_until

    def failed(self, what: str, exc: BaseException) -> None:
        """``what`` (a store call) raised ``exc``: off for the back-off, logged once per outage."""
        with self._lock:
            now = self._clock()
            if now < self._off_until:
                return  # already off: calls that were in flight fail too
            self._off_until = now + self.backoff_s
            self.outages += 1
        log.warning("connector: store unavailable (%s: %s: %s); loads and saves are off for %.0f s",
                    what, type(exc).__name__, exc, self.backoff_s)
