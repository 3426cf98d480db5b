"""Least-recently-used eviction: the baseline every other policy is measured against."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[Hashable, int] = OrderedDict()  # key -> its latest access, least recent first
        self._clock = itertools.count()

    def on_hit(self, key: Hashable) -> None:
        if key in self._order:
            self._order[key] = next(self._clock)
            self._order.move_to_end(key)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._order[key] = next(self._clock)
        self._order.move_to_end(key)

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        self._order.pop(key, None)  # handed back, it is the most recent: nothing to remember

    def evict(self) -> Hashable:
        if not self._order:
            raise LookupError("no resident key to evict")
        key, _ = self._order.popitem(last=False)
        return key

    def victim_rank(self, key: Hashable) -> int | None:
        return self._order.get(key)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order
