"""LRFU (Lee et al., IEEE Trans. Computers 2001): evict the key with the least combined
recency and frequency (CRF).

Every access adds 1 to a key's CRF, and every CRF halves each ``half_life`` of traffic, so a
key accessed four times long ago can outrank one accessed once just now. The half-life is
counted in capacities of bytes accessed (``half_life=8``: eight times the cache's size in
traffic halves a key's weight), so the same setting means the same thing in a small tier
and a large one. The CRFs of evicted keys are remembered while they are among the
``history`` x (resident keys) most recently accessed: a key that comes back keeps its
frequency, which is what lets LRFU keep a chat trace's popular prefixes in a small cache
where LRU keeps churning.

Between two of its accesses a key's CRF decays exactly like every other key's, so the
eviction order only changes when a key is accessed: the heap is keyed by
``log2(CRF at last access) + last access time / half-life``, and eviction is O(log n).

A key the owner holds out of the policy (``on_remove``) keeps its CRF apart from that
history (it is not gone, only held), bounded like every policy's removed keys; a hit
while it is out is an access as usual, and handed back (``on_insert``) it returns with
its CRF.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.removed import RemovedKeys

HALF_LIFE = 8.0  # capacities of accessed bytes that halve a key's CRF
HISTORY = 16.0  # keys whose CRF is remembered, per resident key (the most recently accessed)


class LRFUPolicy(EvictionPolicy):
    name = "lrfu"

    def __init__(self, capacity_bytes: int, half_life: float = HALF_LIFE, history: float = HISTORY) -> None:
        super().__init__(capacity_bytes)
        if half_life <= 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self._half_life = half_life * capacity_bytes
        self._history = history
        self._now = 0  # bytes accessed so far
        self._crf: dict[Hashable, tuple[float, int, int]] = {}  # key -> (CRF, time of last access, size)
        self._resident: dict[Hashable, float] = {}  # key -> its priority in the heap
        self._heap: list[tuple[float, int, Hashable]] = []  # (priority, push order, key); stale entries skipped
        self._pushes = 0
        self._recent: OrderedDict[Hashable, None] = OrderedDict()  # keys with a CRF, least recently accessed first
        self._mean_size = 1.0
        self._removed: RemovedKeys[tuple[float, int, int]] = RemovedKeys()  # removed key -> its _crf entry

    def _access(self, key: Hashable) -> None:
        held = self._removed.get(key)
        crf, last, size = held or self._crf.get(key, (0.0, self._now, round(self._mean_size)))
        crf = crf * 2.0 ** ((last - self._now) / self._half_life) + 1.0
        if held is not None:
            self._removed.put(key, (crf, self._now, size))
        else:
            self._crf[key] = (crf, self._now, size)
            self._remember(key)
            if key in self._resident:
                self._push(key)
        self._now += size

    def _push(self, key: Hashable) -> None:
        crf, last, _ = self._crf[key]
        priority = math.log2(crf) + last / self._half_life
        self._resident[key] = priority
        self._pushes += 1
        heapq.heappush(self._heap, (priority, self._pushes, key))
        if len(self._heap) > 4 * len(self._resident) + 64:  # mostly stale entries: compact
            self._heap = [e for e in self._heap if self._resident.get(e[2]) == e[0]]
            heapq.heapify(self._heap)

    def _remember(self, key: Hashable) -> None:
        """Mark ``key`` most recently accessed; forget the CRFs of the least recently accessed
        non-resident keys beyond ``history`` per resident key. A resident key found at the old
        end is moved to the new end (it is never forgotten), which ends this round."""
        recent = self._recent
        recent[key] = None
        recent.move_to_end(key)
        limit = self._history * (len(self._resident) or 1)
        while len(recent) > limit:
            oldest = next(iter(recent))
            if oldest in self._resident:
                recent.move_to_end(oldest)
                return
            del recent[oldest], self._crf[oldest]

    def on_hit(self, key: Hashable) -> None:
        self._access(key)

    def on_miss(self, key: Hashable) -> None:
        self._release(key)  # the owner does not hold it after all
        self._access(key)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        handed_back = self._removed.pop(key)
        if handed_back is None:
            self._mean_size += (size - self._mean_size) / 64
        crf, last, _ = handed_back or self._crf.get(key, (1.0, self._now, size))
        self._crf[key] = (crf, last, size)
        self._resident[key] = 0.0
        self._remember(key)
        self._push(key)

    def evict(self) -> Hashable:
        while self._heap:
            priority, _, key = heapq.heappop(self._heap)
            if self._resident.get(key) == priority:
                del self._resident[key]
                return key
        raise LookupError("no resident key to evict")

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        """A held key's CRF is kept apart from the history; one gone for good stays in it, like
        an evicted key's."""
        if self._resident.pop(key, None) is not None and held:
            del self._recent[key]
            self._removed.put(key, self._crf.pop(key))
        elif not held:
            self._release(key)

    def _release(self, key: Hashable) -> None:
        """A held key its owner no longer holds: the CRF rejoins the history."""
        crf = self._removed.pop(key)
        if crf is not None:
            self._crf[key] = crf
            self._remember(key)

    def victim_rank(self, key: Hashable) -> float | None:
        """The key's priority in ``evict``'s heap (its CRF in log form plus its last access)."""
        return self._resident.get(key)

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident
