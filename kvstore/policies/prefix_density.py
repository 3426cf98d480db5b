"""``prefix-density``: our default policy. Evict the prefix *leaf* that earns the fewest hits per
unit of cache time.

Three ideas, none tied to a workload:

- **Prefix leaves only.** A chunk is only usable when every chunk before it is resident,
  so evicting an interior chunk strands its descendants. The policy tracks each resident
  chunk's resident children and only ever evicts leaves, so a prefix shrinks from its
  end and stays usable; shared system prompts, which many prefixes run through, stay.
- **Reuse interval predicted per key.** A key's last inter-access interval predicts its
  next one (a conversation's turns come at the user's pace). A new chunk has no interval
  yet; it inherits its parent's, because it extends a prefix that was just reused and
  will be reused when that prefix is next.
- **Hit density, learned online** (``hit_density.HitDensity``). Keys are classed by their
  predicted interval (in octaves) and by whether they were ever hit; per class the policy
  learns how hits are spread over age and evicts the sampled leaf with the lowest
  expected hits per unit of space-time. Classes whose predictions are worthless simply
  learn flat curves; on workloads where recency is all there is, density falls with age
  and the policy behaves like LRU.

Eviction samples ``SAMPLES`` leaves (seeded, so runs repeat) and evicts the worst: O(1)
per eviction; the density tables are refreshed every ``REFRESH`` accesses.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Hashable

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.hit_density import EXACT, NUM_BUCKETS, HitDensity

SAMPLES = 32
REFRESH = 4096
OCTAVES = 32  # predicted intervals up to 2**31 accesses
GHOSTS_PER_KEY = 8  # evicted keys remembered per resident key


def _bucket(age: int) -> int:
    if age < EXACT:
        return age
    n = age.bit_length()
    return min(NUM_BUCKETS - 1, EXACT + (n - 4) * 4 + (age >> (n - 3)) - 4)


class PrefixDensityPolicy(EvictionPolicy):
    name = "prefix-density"

    def __init__(self, capacity_bytes: int, seed: int = 0) -> None:
        super().__init__(capacity_bytes)
        self._stats = HitDensity(2 * (OCTAVES + 1))
        self._rng = random.Random(seed)
        self._clock = 0
        self._last: dict[Hashable, int] = {}  # resident key -> clock of its last access
        self._class: dict[Hashable, int] = {}  # resident key -> its class
        self._interval: dict[Hashable, int] = {}  # resident key -> predicted reuse interval (0: none)
        self._parent: dict[Hashable, Hashable | None] = {}
        self._kids: dict[Hashable, int] = {}  # resident key -> resident children
        self._leaves: list[Hashable] = []  # resident keys without resident children
        self._leaf_pos: dict[Hashable, int] = {}
        # evicted key -> (class, age bucket at eviction, clock of last access)
        self._ghosts: OrderedDict[Hashable, tuple[int, int, int]] = OrderedDict()
        self._returning: tuple[Hashable, int] | None = None  # a ghost being reinserted, its interval

    def _set_class(self, key: Hashable, interval: int, reused: bool) -> None:
        self._interval[key] = interval
        self._class[key] = 2 * min(interval.bit_length(), OCTAVES) + reused

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
        self._clock += 1
        if self._clock % REFRESH == 0:
            self._stats.refresh()
        last = self._last.get(key)
        if last is None:
            return
        age = self._clock - last
        self._stats.hits[self._class[key]][_bucket(age)] += 1
        self._set_class(key, age, True)
        self._last[key] = self._clock

    def on_miss(self, key: Hashable) -> None:
        """A ghost coming back turns its eviction into the hit it would have been.

        Without this the statistics would only ever see hits younger than the current
        eviction age, and could never learn that keeping a class longer pays.
        """
        self._clock += 1
        if self._clock % REFRESH == 0:
            self._stats.refresh()
        ghost = self._ghosts.pop(key, None)
        self._returning = None
        if ghost is not None:
            cls, evicted_at, last = ghost
            evictions = self._stats.evictions[cls]
            evictions[evicted_at] = max(0.0, evictions[evicted_at] - 1)
            interval = self._clock - last
            self._stats.hits[cls][_bucket(interval)] += 1
            self._returning = (key, interval)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._last[key] = self._clock
        if self._returning is not None and self._returning[0] == key:
            self._set_class(key, self._returning[1], True)
        else:
            self._set_class(key, self._interval.get(parent, 0), False)
        self._parent[key] = parent
        self._kids[key] = 0
        self._add_leaf(key)
        if parent in self._kids:
            self._kids[parent] += 1
            self._drop_leaf(parent)

    def _forget(self, key: Hashable) -> None:
        self._drop_leaf(key)
        del self._last[key], self._kids[key], self._class[key], self._interval[key]
        parent = self._parent.pop(key)
        if parent in self._kids:
            self._kids[parent] = max(0, self._kids[parent] - 1)
            if self._kids[parent] == 0 and parent not in self._leaf_pos:
                self._add_leaf(parent)

    def evict(self) -> Hashable:
        leaves = self._leaves
        if not leaves:
            if not self._last:
                raise LookupError("no resident key to evict")
            self._add_leaf(next(iter(self._last)))  # only reachable through a cycle of parents
        density, clock, last, cls = self._stats.density, self._clock, self._last, self._class
        n, rand = len(leaves), self._rng.random
        best, best_density, best_age = None, 0.0, -1
        for _ in range(min(SAMPLES, n)):
            key = leaves[int(rand() * n)]
            age = clock - last[key]
            d = density[cls[key]][_bucket(age)]
            if best is None or d < best_density or (d == best_density and age > best_age):
                best, best_density, best_age = key, d, age
        evicted_at = _bucket(best_age)
        self._stats.evictions[cls[best]][evicted_at] += 1
        self._ghosts[best] = (cls[best], evicted_at, last[best])
        self._forget(best)
        while len(self._ghosts) > GHOSTS_PER_KEY * max(1, len(last)):
            self._ghosts.popitem(last=False)
        return best

    def on_remove(self, key: Hashable) -> None:
        if key in self._last:
            self._forget(key)

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._last
