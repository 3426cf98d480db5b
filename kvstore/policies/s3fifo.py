"""S3-FIFO (Yang et al., SOSP'23): a small probation FIFO, a main FIFO and a ghost FIFO.

New keys enter the small queue (10% of capacity); most are seen once and leave from
there quickly, remembered only as ghosts. A key accessed while in the small queue moves
to main on its way out; a ghost that comes back goes straight to main. Main is a FIFO
with a small saturating frequency counter that buys a key another lap (lazy promotion,
no reordering on hits), which makes hits cheap.

A key the owner holds out of the policy (``on_remove``) is remembered with its queue and
frequency; a hit while it is out counts as one on a resident key would, and handed back
it rejoins the same queue (at the tail) with that frequency.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.removed import RemovedKeys

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
        self._removed: RemovedKeys[tuple[bool, int]] = RemovedKeys()  # removed key -> (in main, frequency)

    def on_hit(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(MAX_FREQ, self._freq[key] + 1)
        else:
            self._removed.hit(key, lambda standing: (standing[0], min(MAX_FREQ, standing[1] + 1)))

    def on_miss(self, key: Hashable) -> None:
        self._removed.pop(key)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        handed_back = self._removed.pop(key)
        if handed_back is not None:
            main, self._freq[key] = handed_back
        else:
            self._freq[key] = 0
            main = key in self._ghost
            if main:
                self._ghost_bytes -= self._ghost.pop(key)
        if main:
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

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        freq = self._freq.pop(key, None)
        main = key in self._main
        if main:
            self._main_bytes -= self._main.pop(key)
        elif freq is not None:
            self._small_bytes -= self._small.pop(key)
        self._removed.removed(key, None if freq is None else (main, freq), held)

    def victim_rank(self, key: Hashable) -> tuple[int, int] | None:
        """Fewest hits since insertion first; among equals, the small queue's before the
        main one's."""
        freq = self._freq.get(key)
        return None if freq is None else (freq, key in self._main)

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._freq
