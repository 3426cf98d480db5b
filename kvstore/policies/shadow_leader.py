"""``shadow-leader``: our default policy. Run several policies as metadata-only shadows of the
cache and let the one that has been hitting most decide what the real cache evicts.

No single eviction order wins everywhere: on chat traces a frequency/IRR policy (LIRS)
wins small caches by far and loses large ones to recency (LRU, ARC). Which regime a
tier is in depends on its size and on the workload of the hour, so instead of guessing,
the policy measures. Every access is replayed into each expert, which keeps its own
resident set over the same capacity (keys and sizes only, no data); hits are counted
per window of accesses. The expert with the best recent hit rate (with hysteresis, so
the cache does not thrash between experts) is the *leader*, and the real cache evicts
keys the leader no longer holds, oldest first, so its contents converge to the
leader's. With one expert (and without tail dropping) this is exactly that expert.

One prefix-aware rule applies on top, for every expert: when a new prompt starts (a
chunk without parent is accessed), the chunk inserted just before it never got a child,
so it was the previous prompt's partly filled last chunk, whose hash no later prompt
can share; it is dropped from the shadows and evicted first. (A Store that only saves
full chunks never has such tails; then the rule never fires.)

Cost: each access costs one step of every expert, O(1) each; memory is that of the
experts' metadata. Switching leader rebuilds the eviction queue once (O(resident)).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

from kvstore.policies.arc import ARCPolicy
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lirs import LIRSPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.s3fifo import S3FIFOPolicy

WINDOW = 2048  # accesses per scoring window
SMOOTHING = 0.1  # weight of the newest window in each expert's score
MARGIN = 1.02  # a challenger must beat the leader's score by this factor
LONG_HISTORY = 4.0  # LIRS's remembered non-resident keys per resident key, for small caches

EXPERTS: tuple[Callable[[int], EvictionPolicy], ...] = (
    LRUPolicy,
    ARCPolicy,
    S3FIFOPolicy,
    lambda capacity: LIRSPolicy(capacity, history=LONG_HISTORY),
)


@dataclass
class _Shadow:
    policy: EvictionPolicy
    sizes: dict[Hashable, int] = field(default_factory=dict)
    used: int = 0
    window_hits: int = 0
    score: float = 0.0


class ShadowLeaderPolicy(EvictionPolicy):
    name = "shadow-leader"

    def __init__(self, capacity_bytes: int, experts=EXPERTS, drop_tails: bool = True) -> None:
        super().__init__(capacity_bytes)
        self._drop_tails = drop_tails
        self._shadows = [_Shadow(make(capacity_bytes)) for make in experts]
        self._leader = self._shadows[0]
        self._resident: dict[Hashable, tuple[int, Hashable | None]] = {}  # key -> (size, parent)
        self._unwanted: OrderedDict[Hashable, None] = OrderedDict()  # resident, not in the leader
        self._accesses = 0
        self._fresh: Hashable | None = None  # the key inserted by the latest access, if any

    def _drop_tail(self) -> None:
        """A new prompt starts: the block inserted just before it got no child, so it is the
        previous prompt's partly filled last block, which no later prompt can share."""
        tail, self._fresh = self._fresh, None
        if tail is None or tail not in self._resident:
            return
        for shadow in self._shadows:
            if tail in shadow.sizes:
                shadow.used -= shadow.sizes.pop(tail)
                shadow.policy.on_remove(tail)
        self._unwanted[tail] = None
        self._unwanted.move_to_end(tail, last=False)

    def _replay(self, key: Hashable, size: int, parent: Hashable | None) -> None:
        """One access in every shadow; keeps ``_unwanted`` equal to resident minus leader."""
        if parent is None and self._drop_tails:
            self._drop_tail()
        for shadow in self._shadows:
            policy, sizes = shadow.policy, shadow.sizes
            if key in sizes:
                shadow.window_hits += 1
                policy.on_hit(key)
                continue
            policy.on_miss(key)
            if not policy.admit(key, size, parent):
                continue
            sizes[key] = size
            shadow.used += size
            policy.on_insert(key, size, parent)
            while shadow.used > self.capacity_bytes:
                victim = policy.evict()
                shadow.used -= sizes.pop(victim)
                if shadow is self._leader and victim in self._resident:
                    self._unwanted[victim] = None
        if key in self._leader.sizes:
            self._unwanted.pop(key, None)
        elif key in self._resident:
            self._unwanted[key] = None
        self._accesses += 1
        if self._accesses % WINDOW == 0:
            self._rescore()

    def _rescore(self) -> None:
        for shadow in self._shadows:
            shadow.score = (1 - SMOOTHING) * shadow.score + SMOOTHING * shadow.window_hits
            shadow.window_hits = 0
        best = max(self._shadows, key=lambda s: s.score)
        if best is not self._leader and best.score > MARGIN * self._leader.score:
            self._leader = best
            self._unwanted = OrderedDict((k, None) for k in self._resident if k not in best.sizes)

    def on_hit(self, key: Hashable) -> None:
        if key in self._resident:
            self._replay(key, *self._resident[key])
            self._fresh = None

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._resident[key] = (size, parent)
        self._replay(key, size, parent)
        self._fresh = key

    def evict(self) -> Hashable:
        if not self._resident:
            raise LookupError("no resident key to evict")
        while self._unwanted:
            key, _ = self._unwanted.popitem(last=False)
            if key in self._resident:
                del self._resident[key]
                return key
        leader = self._leader  # it holds everything we hold: let it choose
        while leader.sizes:
            key = leader.policy.evict()
            leader.used -= leader.sizes.pop(key)
            if key in self._resident:
                del self._resident[key]
                return key
        key = next(iter(self._resident))
        del self._resident[key]
        return key

    def on_remove(self, key: Hashable) -> None:
        self._resident.pop(key, None)

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident
