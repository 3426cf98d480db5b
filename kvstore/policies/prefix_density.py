"""``prefix-density``: our default policy. Evict the prefix *leaf* that earns the fewest hits per
unit of cache time.

Two ideas, neither tied to a workload:

- **Prefix leaves only.** A chunk is only usable when every chunk before it is resident,
  so evicting an interior chunk strands its descendants. The policy tracks each resident
  chunk's resident children and only ever evicts leaves, so a prefix shrinks from its
  end and stays usable; shared system prompts, which many prefixes run through, stay.
- **Hit density, learned online** (``hit_density.HitDensity``). Keys are classed by how
  often they have been accessed (counts survive eviction in a bounded ghost table); per
  class the policy learns how hits are spread over age, and evicts the sampled leaf with
  the lowest expected hits per unit of space-time. Single-use chunks (most of a chat
  trace) lose density as soon as they outlive their class's typical reuse time, while
  reused chunks keep it; on workloads where recency is all there is, density falls with
  age and the policy behaves like LRU.

Eviction samples ``SAMPLES`` leaves (seeded, so runs repeat) and evicts the worst: O(1)
per eviction; the density tables are refreshed every ``REFRESH`` accesses.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.hit_density import HitDensity, age_bucket

SAMPLES = 32
REFRESH = 4096
MAX_CLASS = 6  # access counts 1..6+ each get a class


class PrefixDensityPolicy(EvictionPolicy):
    name = "prefix-density"

    def __init__(self, capacity_bytes: int, seed: int = 0) -> None:
        super().__init__(capacity_bytes)
        self._stats = HitDensity(MAX_CLASS)
        self._rng = random.Random(seed)
        self._clock = 0
        self._last: dict[Hashable, int] = {}  # resident key -> clock of its last access
        self._count: dict[Hashable, int] = {}  # resident key -> accesses so far
        self._parent: dict[Hashable, Hashable | None] = {}
        self._kids: dict[Hashable, int] = {}  # resident key -> resident children
        self._leaves: list[Hashable] = []  # resident keys without resident children
        self._leaf_pos: dict[Hashable, int] = {}
        self._ghost_count: OrderedDict[Hashable, int] = OrderedDict()  # evicted key -> accesses

    def _tick(self) -> None:
        self._clock += 1
        if self._clock % REFRESH == 0:
            self._stats.refresh()

    def _class(self, key: Hashable) -> int:
        return min(self._count[key], MAX_CLASS) - 1

    def _add_leaf(self, key: Hashable) -> None:
        self._leaf_pos[key] = len(self._leaves)
        self._leaves.append(key)

    def _drop_leaf(self, key: Hashable) -> None:
        i = self._leaf_pos.pop(key, None)
        if i is None:
            return
        last = self._leaves.pop()
        if last != key:
            self._leaves[i] = last
            self._leaf_pos[last] = i

    def on_hit(self, key: Hashable) -> None:
        self._tick()
        if key not in self._last:
            return
        age = self._clock - self._last[key]
        self._stats.hits[self._class(key)][age_bucket(age)] += 1
        self._count[key] += 1
        self._last[key] = self._clock

    def on_miss(self, key: Hashable) -> None:
        self._tick()

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._last[key] = self._clock
        self._count[key] = self._ghost_count.pop(key, 0) + 1
        self._parent[key] = parent
        self._kids[key] = 0
        self._add_leaf(key)
        if parent in self._kids:
            self._kids[parent] += 1
            self._drop_leaf(parent)

    def _forget(self, key: Hashable) -> None:
        self._drop_leaf(key)
        del self._last[key], self._kids[key]
        parent = self._parent.pop(key)
        if parent in self._kids:
            self._kids[parent] = max(0, self._kids[parent] - 1)
            if self._kids[parent] == 0 and parent not in self._leaf_pos:
                self._add_leaf(parent)
        self._ghost_count[key] = self._count.pop(key)
        while len(self._ghost_count) > 2 * max(1, len(self._last)):
            self._ghost_count.popitem(last=False)

    def evict(self) -> Hashable:
        leaves = self._leaves
        if not leaves:
            if not self._last:
                raise LookupError("no resident key to evict")
            self._add_leaf(next(iter(self._last)))  # a cycle of parents cannot happen with real hashes
        density, clock, n = self._stats.density, self._clock, len(leaves)
        best = None
        for _ in range(min(SAMPLES, n)):
            key = leaves[int(self._rng.random() * n)]
            age = clock - self._last[key]
            score = (density[self._class(key)][age_bucket(age)], -age)
            if best is None or score < best_score:
                best, best_score = key, score
        age = clock - self._last[best]
        self._stats.evictions[self._class(best)][age_bucket(age)] += 1
        self._forget(best)
        return best

    def on_remove(self, key: Hashable) -> None:
        if key in self._last:
            self._forget(key)

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._last
