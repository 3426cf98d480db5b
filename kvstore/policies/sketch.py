"""Count-min frequency sketch with periodic halving (the TinyLFU frequency estimate).

Four rows of small saturating counters; an estimate is the minimum over the rows. After
``sample_size`` increments every counter is halved, so old popularity fades and the
sketch follows a changing workload.
"""

from __future__ import annotations

from typing import Hashable

ROWS = 4
MAX_COUNT = 15
_SEEDS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)


class FrequencySketch:
    def __init__(self, width: int, sample_size: int) -> None:
        self._width = max(16, 1 << (max(1, width) - 1).bit_length())
        self._mask = self._width - 1
        self._rows = [[0] * self._width for _ in range(ROWS)]
        self._sample_size = max(1, sample_size)
        self._added = 0

    def _slots(self, key: Hashable) -> list[int]:
        h = hash(key)
        return [((h ^ s) * 0x100000001B3 >> 7) & self._mask for s in _SEEDS]

    def increment(self, key: Hashable) -> None:
        for row, i in zip(self._rows, self._slots(key)):
            if row[i] < MAX_COUNT:
                row[i] += 1
        self._added += 1
        if self._added >= self._sample_size:
            self._added //= 2
            for row in self._rows:
                row[:] = [c >> 1 for c in row]

    def estimate(self, key: Hashable) -> int:
        return min(row[i] for row, i in zip(self._rows, self._slots(key)))
