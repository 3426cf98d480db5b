"""W-TinyLFU (Einziger, Friedman & Manes, 2017): a small LRU window in front of an SLRU main
cache guarded by a frequency-sketch admission filter.

New keys land in the window (1%), which absorbs bursts. A key leaving the window only
enters the main cache if the sketch says it is more popular than the main cache's next
victim; so one-hit wonders rarely displace established keys. The main cache is
segmented LRU: probation (20%) for keys seen once there, protected (80%) for the rest.

A key the owner holds out of the policy (``on_remove``) is remembered with its segment:
handed back, it returns to the same segment (most recent end). A hit while it is out is
counted in the sketch at once and, as on a resident key, moves it from probation to
protected.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.removed import RemovedKeys
from kvstore.policies.sketch import FrequencySketch

WINDOW_FRACTION = 0.01
PROTECTED_FRACTION = 0.8
_AFTER_HIT = {"window": "window", "probation": "protected", "protected": "protected"}


class WTinyLFUPolicy(EvictionPolicy):
    name = "wtinylfu"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._window_limit = max(1, int(capacity_bytes * WINDOW_FRACTION))
        self._protected_limit = int((capacity_bytes - self._window_limit) * PROTECTED_FRACTION)
        self._window: OrderedDict[Hashable, int] = OrderedDict()
        self._probation: OrderedDict[Hashable, int] = OrderedDict()
        self._protected: OrderedDict[Hashable, int] = OrderedDict()
        self._bytes = {"window": 0, "probation": 0, "protected": 0}
        self._sketch: FrequencySketch | None = None  # rebuilt whenever the resident count doubles
        self._sketch_keys = 0
        self._removed: RemovedKeys[str] = RemovedKeys()  # removed key -> its segment

    def _count(self, key: Hashable) -> None:
        if self._sketch is None or len(self) > self._sketch_keys:
            self._sketch_keys = max(64, 2 * len(self))
            self._sketch = FrequencySketch(self._sketch_keys, 10 * self._sketch_keys)
        self._sketch.increment(key)

    def _estimate(self, key: Hashable) -> int:
        """The sketch's count of ``key``; 0 before any hit or miss was counted (an owner that
        only inserts, as a store taking puts does, has no sketch yet)."""
        return 0 if self._sketch is None else self._sketch.estimate(key)

    def _move(self, key: Hashable, src: str, dst: str) -> None:
        size = getattr(self, "_" + src).pop(key)
        self._bytes[src] -= size
        getattr(self, "_" + dst)[key] = size
        self._bytes[dst] += size

    def on_hit(self, key: Hashable) -> None:
        self._count(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._probation:
            self._move(key, "probation", "protected")
            self._fit_protected()
        elif key in self._protected:
            self._protected.move_to_end(key)
        else:
            self._removed.hit(key, _AFTER_HIT.__getitem__)

    def _fit_protected(self) -> None:
        while self._bytes["protected"] > self._protected_limit and len(self._protected) > 1:
            self._move(next(iter(self._protected)), "protected", "probation")

    def on_miss(self, key: Hashable) -> None:
        self._removed.pop(key)
        self._count(key)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        segment = self._removed.pop(key) or "window"
        getattr(self, "_" + segment)[key] = size
        self._bytes[segment] += size
        if segment == "protected":
            self._fit_protected()

    def _pop(self, segment: str) -> Hashable:
        key, size = getattr(self, "_" + segment).popitem(last=False)
        self._bytes[segment] -= size
        return key

    def evict(self) -> Hashable:
        if not len(self):
            raise LookupError("no resident key to evict")
        main_limit = self.capacity_bytes - self._window_limit
        while self._bytes["window"] > self._window_limit:
            candidate = next(iter(self._window))
            main_bytes = self._bytes["probation"] + self._bytes["protected"]
            if main_bytes + self._window[candidate] > main_limit:
                break
            self._move(candidate, "window", "probation")  # the main cache is still filling
        if self._bytes["window"] <= self._window_limit or not self._window:
            if not self._probation and not self._protected:  # owner short of room for keys it holds
                return self._pop("window")
            return self._pop("probation" if self._probation else "protected")
        candidate = next(iter(self._window))
        victim_segment = "probation" if self._probation else "protected"
        if not getattr(self, "_" + victim_segment):
            return self._pop("window")
        victim = next(iter(getattr(self, "_" + victim_segment)))
        if self._estimate(candidate) > self._estimate(victim):
            self._move(candidate, "window", "probation")
            return self._pop(victim_segment)
        return self._pop("window")

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        segment = next((s for s in ("window", "probation", "protected") if key in getattr(self, "_" + s)), None)
        if segment is not None:
            self._bytes[segment] -= getattr(self, "_" + segment).pop(key)
        self._removed.removed(key, segment, held)

    def victim_rank(self, key: Hashable) -> tuple[int, bool] | None:
        """The sketch's count of the key, lowest first (TinyLFU's admission test); among
        equals, unprotected keys first."""
        return (self._estimate(key), key in self._protected) if key in self else None

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._window or key in self._probation or key in self._protected
