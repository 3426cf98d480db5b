"""A bandwidth cap around any tier, to emulate slower media in tests and benchmarks.

Reads and writes of one tier share one cap, like one device: each transfer of ``n`` bytes
books ``n / bytes_per_s`` seconds on the device's timeline and returns when its slot
ends, so concurrent callers queue exactly as they would on a saturated link.
"""

from __future__ import annotations

import threading
import time
from typing import Sequence

from tiers.base import Buffer, Tier
from tiers.wrapped import WrappedTier


class ThrottledTier(WrappedTier):
    def __init__(self, inner: Tier, bytes_per_s: float) -> None:
        if bytes_per_s <= 0:
            raise ValueError(f"bandwidth cap must be positive, got {bytes_per_s}")
        super().__init__(inner)
        self.bytes_per_s = float(bytes_per_s)
        self._lock = threading.Lock()
        self._free_at = 0.0

    def _occupy(self, nbytes: int, started: float) -> None:
        """Book the device for ``nbytes`` (from when the caller started) and wait for the slot's end."""
        with self._lock:
            begin = max(started, self._free_at)
            self._free_at = end = begin + nbytes / self.bytes_per_s
        delay = end - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        started = time.perf_counter()
        self.inner.write(key, parts)
        self._occupy(sum(memoryview(p).nbytes for p in parts), started)

    def read(self, key: bytes):
        started = time.perf_counter()
        data = self.inner.read(key)
        if data is not None:
            self._occupy(len(data), started)
        return data

    def read_into(self, key: bytes, out) -> int | None:
        started = time.perf_counter()
        got = self.inner.read_into(key, out)
        if got is not None:
            self._occupy(got, started)
        return got
