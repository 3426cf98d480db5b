"""S3-FIFO (Yang et al., SOSP'23): a small probation FIFO, a main FIFO and a ghost FIFO.

New keys enter the small queue (10% of capacity); most are seen once and leave from
there quickly, remembered only as ghosts. A key accessed while in the small queue moves
to main on its way out; a ghost that comes back goes straight to main. Main is a FIFO
with a small saturating frequency counter that buys a key another lap (lazy promotion,
no reordering on hits), which makes hits cheap.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy

SMALL_FRACTION = 0.1
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    name = "s3fifo"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._small: OrderedDict[Hashable, int] = OrderedDict()  # key -> size
        self._main: OrderedDict[Hashable, int] = OrderedDict()
        self._ghost: OrderedDict[Hashable, int] = OrderedDict()
        self._freq: dict[Hashable, int] = {}
        self._small_bytes = self._main_bytes = self._ghost_bytes = 0

    def on_hit(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(MAX_FREQ, self._freq[key] + 1)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._freq[key] = 0
        if key in self._ghost:
            self._ghost_bytes -= self._ghost.pop(key)
            self._main[key] = size
            self._main_bytes += size
        else:
            self._small[key] = size
            self._small_bytes += size

    def _remember(self, key: Hashable, size: int) -> None:
        self._ghost[key] = size
        self._ghost_bytes += size
        while self._ghost_bytes > self.capacity_bytes * (1 - SMALL_FRACTION) and self._ghost:
            self._ghost_bytes -= self._ghost.popitem(last=False)[1]

    def evict(self) -> Hashable:
        while self._small or self._main:
            if self._small and (self._small_bytes >= self.capacity_bytes * SMALL_FRACTION or not self._main):
                key, size = self._small.popitem(last=False)
                self._small_bytes -= size
                if self._freq[key] > 0:
                    self._freq[key] = 0
                    self._main[key] = size
                    self._main_bytes += size
                    continue
                del self._freq[key]
                self._remember(key, size)
                return key
            key, size = self._main.popitem(last=False)
            if self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = size
                continue
            self._main_bytes -= size
            del self._freq[key]
            return key
        raise LookupError("no resident key to evict")

    def on_remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is None:
            return
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        else:
            self._main_bytes -= self._main.pop(key)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._freq
