"""Chunk-sized host buffers between the store and the paged KV cache, reused across steps.

Reuse matters: a fresh buffer faults in every page on first touch, several times slower
than copying into one already mapped. On a GPU they are pinned, so copies to and from the
device run at DMA speed. A buffer belongs to whoever took it until it is given back; one a
store read may still be writing (a read that missed or was abandoned) is discarded instead.
"""

from __future__ import annotations

import threading

import torch


class StagingPool:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin_memory: bool, keep: int,
                 limit: int | None = None, prefault: int = 0) -> None:
        """``keep`` idle buffers are kept for reuse; at most ``limit`` are out at once (None: no
        limit); ``prefault`` buffers are made and touched now, so the first loads reuse them."""
        self.shape, self.dtype, self.pin_memory = shape, dtype, pin_memory
        self.keep, self.limit = keep, limit
        self._idle = [self._fresh().zero_() for _ in range(min(prefault, keep))]
        self._out = 0
        self._lock = threading.Lock()

    def _fresh(self) -> torch.Tensor:
        # never an inference tensor, though a load may take one during the forward: a loader
        # thread, outside inference mode, cannot write one in place
        with torch.inference_mode(False):
            return torch.empty(self.shape, dtype=self.dtype, pin_memory=self.pin_memory)

    @property
    def outstanding(self) -> int:
        """Buffers taken and neither given back nor discarded (0 once nothing is in flight)."""
        with self._lock:
            return self._out

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize

    def take(self) -> torch.Tensor | None:
        """An idle buffer, or a fresh one; None when ``limit`` buffers are out."""
        with self._lock:
            if self.limit is not None and self._out >= self.limit:
                return None
            self._out += 1
            if self._idle:
                return self._idle.pop()
        return self._fresh()

    def give(self, buf: torch.Tensor) -> None:
        """Back for reuse: nothing writes ``buf`` any more."""
        with self._lock:
            self._out -= 1
            if len(self._idle) < self.keep:
                self._idle.append(buf)

    def discard(self, buf: torch.Tensor) -> None:
        """Never reuse ``buf``: a read that did not complete may still write it."""
        with self._lock:
            self._out -= 1
