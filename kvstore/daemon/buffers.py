"""Reusable payload buffers for chunks in flight (bulk frames, inline pieces, reads for the
socket).

A fresh chunk-sized allocation costs page faults on every page it touches (measured here:
~300 faults and ~1 ms of CPU per 4 MiB chunk in an executor thread, whose malloc arena gives
memory back eagerly), more than the copy it is for. So buffers are kept for reuse, up to
``max_bytes`` idle in total, by size rounded up to 64 KiB: blobs of one deployment differ in
size only by their encoding (lz4, int8, ...), and exact sizes, some of which never recur, would
each keep buffers of their own.
"""

from __future__ import annotations

import threading

import numpy as np

GRANULE = 64 << 10


class BufferPool:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._idle: dict[int, list[np.ndarray]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A uint8 array of exactly ``nbytes`` (contents undefined); give it back when done."""
        capacity = -(-max(nbytes, 1) // GRANULE) * GRANULE
        with self._lock:
            idle = self._idle.get(capacity)
            if idle:
                self._idle_bytes -= capacity
                return idle.pop()[:nbytes]
        return np.empty(capacity, dtype=np.uint8)[:nbytes]

    def give(self, buf: np.ndarray) -> None:
        whole = buf if buf.base is None else buf.base
        with self._lock:
            if self._idle_bytes + whole.nbytes <= self.max_bytes:
                self._idle.setdefault(whole.nbytes, []).append(whole)
                self._idle_bytes += whole.nbytes
