"""``shadow-vote``: our default policy. Run several policies as metadata-only shadows of the
cache; the real cache keeps what the recently best of them would keep, and evicts first
what none of them wants.

No single eviction order wins everywhere: on chat traces frequency-aware policies (LIRS,
LRFU with a long half-life) win small caches by far and lose large ones to recency (LRU,
ARC), and on other workloads several policies tie. Which regime a tier is in depends on
its size and on the workload of the hour, so instead of guessing, the policy measures:

- Every access is replayed into each expert (LRU, ARC, S3-FIFO, a long-history LIRS and
  LRFU at three half-lives), which keeps its own resident set over the same capacity
  (keys and sizes only, no data). Hits are counted per window of accesses and smoothed
  into a score; the first windows are short (``FIRST_WINDOW``, doubling), so the vote
  leaves the first expert early and a trace shorter than a window is scored too.
- Each expert's vote weighs ``(score / best score) ** SHARPNESS``: the leader weighs 1,
  an expert 0.1% behind about 0.8, 1% behind about 0.13, 3% behind nothing to speak of.
  Experts that differ only in a parameter (the LRFUs) are rarely far apart, so the vote
  must be this sharp to follow the best of them. The short score is noisy, though: an
  expert that another beats window after window by a hair still came near the lead now and
  then, and switching to it and back costs the real cache what it dropped meanwhile. So an
  expert's weight is also at most ``exp(-z**2 / 2)``, z its gap behind the expert that
  beats it most surely, in standard errors of their per-window difference over a long
  memory (``PairedGaps``). A resident key's *support* is
  the weight of the experts holding it; the real cache evicts the key with the least
  support from a heap. A chunk is worth nothing once the chunk before it is gone (a prefix
  loads up to its first miss), so a chunk's support is at most its resident parent's: the
  experts see a prompt's chunks one access apart and often drop a parent just before its
  child (LRFU's count of the parent is one access older), and a vote that followed them
  kept children whose hits no prefix could use. Among equals it evicts the one whose
  prompt came longest ago, and within a prompt the deeper chunk first: oldest-first, which
  would take a prompt's first chunk before its last, strands the rest. A key keeps its
  place among its equals when only its support changes (an expert evicted it, or the
  votes were re-weighed). So it holds what the leader holds, and where near-equal experts
  disagree, what more of them agree on. With one expert (without tail dropping, on
  accesses without parents) this is exactly that expert.
- Prefix tails are dropped: when a new prompt starts (a chunk without parent is
  accessed), the chunk inserted just before it never got a child, so it was the previous
  prompt's partly filled last chunk, whose hash no later prompt can share; it leaves
  every shadow and is evicted first. (A Store that only saves full chunks never has such
  tails; then the rule never fires.) The rule only fires once parents have been reported
  at all (an owner that never passes ``parent`` gives no prompt boundaries). A tail the
  owner holds when the next prompt starts (a Store's first tier while its copies are
  queued) is marked all the same and comes back a tail.
- A key coming back after ``on_remove`` (an owner unpinning a chunk, or a Store's first
  tier once the chunk's copies are done) is resident again but is not an access: the
  experts, which kept it, do not see it twice. A hit while it is out (a pinned chunk
  being loaded) is an access like any other: the experts see it, and the chunk comes
  back with one more hit to its reuse class.

Cost: one step of every expert per access (O(1), O(log n) for the LRFUs), plus O(log n)
heap work for the keys the access touched and for the resident descendants whose capped
support moved with theirs. Which experts hold a key is a bit mask, and the
vote is looked up per mask (summed once per weighting), so re-rating a key asks no
expert's set; re-weighing (rare: only when a weight moves by more than ``REWEIGH``)
rebuilds the heap in O(resident keys).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Callable, Hashable

from kvstore.policies.arc import ARCPolicy
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lirs import LIRSPolicy
from kvstore.policies.lrfu import LRFUPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.removed import RemovedKeys
from kvstore.policies.s3fifo import S3FIFOPolicy

WINDOW = 2048  # accesses per scoring window
FIRST_WINDOW = 64  # the first windows double from this up to WINDOW, so a small trace is scored too
SMOOTHING = 0.1  # weight of the newest window in each expert's score
GAP_SMOOTHING = 0.01  # weight of the newest window in the experts' paired gaps (``PairedGaps``)
SHARPNESS = 200.0  # how fast an expert's vote fades as it falls behind the leader
REWEIGH = 0.05  # re-weigh the votes when a weight moves by more than this
LONG_HISTORY = 4.0  # LIRS's remembered non-resident keys per resident key, for small caches
LRFU_HALF_LIVES = (8.0, 16.0, 32.0)  # in capacities of traffic: from recency-leaning to frequency-leaning
TAIL = -1.0  # support of a dropped prompt tail: below every vote

EXPERT_POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {  # by name, to run them alone too
    "lru": LRUPolicy,
    "arc": ARCPolicy,
    "s3fifo": S3FIFOPolicy,
    f"lirs-h{LONG_HISTORY:g}": lambda capacity: LIRSPolicy(capacity, history=LONG_HISTORY),
    **{f"lrfu-{h:g}": (lambda capacity, h=h: LRFUPolicy(capacity, half_life=h)) for h in LRFU_HALF_LIVES},
}
EXPERTS: tuple[Callable[[int], EvictionPolicy], ...] = tuple(EXPERT_POLICIES.values())


class ReuseClasses:
    """Expected reuse by what a chunk has shown so far, learned online: the chance that a
    resident chunk of each class (a dropped prompt tail, or hit 0, 1, 2+ times since it came
    in) is hit again before it leaves, relative to that chance over all chunks. Nothing is
    assumed about the workload; the counts start even (add-one smoothing)."""

    CLASSES = 4  # 0: prompt tail, 1: no hit yet, 2: one hit, 3: two or more

    def __init__(self) -> None:
        self.hits: dict[Hashable, int] = {}  # resident key -> hits since it came in
        self._again = [0] * self.CLASSES  # chunks of the class that were hit again
        self._left = [0] * self.CLASSES  # chunks of the class that left without another hit

    @staticmethod
    def klass(hits: int, tail: bool) -> int:
        return 0 if tail else 1 + min(hits, 2)

    def on_hit(self, key: Hashable, tail: bool) -> None:
        hits = self.hits.get(key, 0)
        self._again[self.klass(hits, tail)] += 1
        self.hits[key] = hits + 1

    def on_leave(self, key: Hashable, tail: bool) -> int:
        """Count the chunk as gone without another hit; returns its hits."""
        hits = self.hits.pop(key, 0)
        self._left[self.klass(hits, tail)] += 1
        return hits

    def on_return(self, key: Hashable, hits: int, tail: bool) -> None:
        """Undo ``on_leave``: the chunk stayed after all (kept re-encoded)."""
        self._left[self.klass(hits, tail)] -= 1
        if hits:
            self.hits[key] = hits

    def estimate(self, hits: int, tail: bool) -> float:
        c = self.klass(hits, tail)
        p = (self._again[c] + 1) / (self._again[c] + self._left[c] + 2)
        overall = (sum(self._again) + 1) / (sum(self._again) + sum(self._left) + 2)
        return p / overall


class PairedGaps:
    """How far each expert stands behind each other over a long memory, in standard errors
    of the per-window difference of their hit rates (paired: both saw the same accesses).
    An expert that another beats window after window keeps little weight even where the
    short score puts it near the lead for a while: switching to it and back costs the real
    cache what it dropped meanwhile. Where the lead really moves, the differences change
    sign and their spread keeps every gap small."""

    def __init__(self, experts: int) -> None:
        self._n = experts
        self._mean = [[0.0] * experts for _ in range(experts)]  # smoothed rate_j - rate_i
        self._square = [[0.0] * experts for _ in range(experts)]  # smoothed (rate_j - rate_i) ** 2
        self._weight = 0.0  # the smoothing weights' sum and sum of squares (effective windows)
        self._weight_sq = 0.0

    def add(self, rates: list[float]) -> None:
        keep = 1 - GAP_SMOOTHING
        for j in range(self._n):
            mean, square = self._mean[j], self._square[j]
            for i in range(self._n):
                d = rates[j] - rates[i]
                mean[i] = keep * mean[i] + GAP_SMOOTHING * d
                square[i] = keep * square[i] + GAP_SMOOTHING * d * d
        self._weight = keep * self._weight + GAP_SMOOTHING
        self._weight_sq = keep * keep * self._weight_sq + GAP_SMOOTHING * GAP_SMOOTHING

    def standing(self, i: int) -> float:
        """``exp(-z**2 / 2)`` for the largest z by which another expert leads expert ``i``
        (1 if none leads it)."""
        windows = self._weight ** 2 / self._weight_sq if self._weight else 0.0
        if windows < 2:
            return 1.0
        z = 0.0
        for j in range(self._n):
            mean = self._mean[j][i] / self._weight
            if j != i and mean > 0:
                var = (self._square[j][i] / self._weight - mean * mean) * windows / (windows - 1)
                z = max(z, mean / math.sqrt(var / windows)) if var > 0 else math.inf
        return math.exp(-z * z / 2)


@dataclass
class _Shadow:
    policy: EvictionPolicy
    sizes: dict[Hashable, int] = field(default_factory=dict)
    used: int = 0
    window_hits: int = 0
    score: float = 0.0


class ShadowVotePolicy(EvictionPolicy):
    name = "shadow-vote"

    def __init__(self, capacity_bytes: int, experts=EXPERTS, drop_tails: bool = True) -> None:
        super().__init__(capacity_bytes)
        self._drop_tails = drop_tails
        self._shadows = [_Shadow(make(capacity_bytes)) for make in experts]
        self._weights = [1.0] + [0.0] * (len(self._shadows) - 1)  # the first expert leads at first
        self._steps = [(1 << i, shadow, *self._methods(shadow.policy)) for i, shadow in enumerate(self._shadows)]
        self._held: dict[Hashable, int] = {}  # key -> bit mask of the experts holding it (absent: none)
        self._supports: dict[int, float] = {}  # bit mask -> its vote, for the current weights
        self._resident: dict[Hashable, tuple[int, Hashable | None]] = {}  # key -> (size, parent)
        self._support: dict[Hashable, tuple[float, tuple]] = {}  # resident key -> (support, order)
        self._heap: list[tuple[float, tuple, Hashable]] = []  # stale entries are skipped
        self._stamp = 0
        self._prompt = 0  # prompts started so far
        self._depth: dict[Hashable, int] = {}  # resident key -> chunks before it in its prompt
        self._children: dict[Hashable, set[Hashable]] = {}  # key -> its resident children
        self._accesses = 0
        self._next_reweigh = FIRST_WINDOW
        self._window_start = 0  # accesses when the current scoring window began
        self._gaps = PairedGaps(len(self._shadows))
        self._fresh: Hashable | None = None  # the key inserted by the latest access, if any
        self._parents_seen = False
        self._removed: RemovedKeys[tuple[int, bool, int, Hashable | None]] = RemovedKeys()  # -> (hits, tail, size, parent)
        self._reuse = ReuseClasses()
        self._last_victim: tuple[Hashable, int, bool] | None = None  # (key, hits, tail) of the latest evict

    @staticmethod
    def _methods(policy: EvictionPolicy) -> tuple:
        """An expert's calls, bound once; ``admit`` is None where it is the base class's
        (admit everything), so the step skips the call."""
        admits = type(policy).admit is not EvictionPolicy.admit
        return policy.on_hit, policy.on_miss, policy.admit if admits else None, policy.on_insert, policy.evict

    def _vote(self, key: Hashable) -> float:
        """The weight of the experts holding ``key``, summed in expert order (so keys held by
        the same experts tie exactly), cached per set of holders."""
        mask = self._held.get(key, 0)
        support = self._supports.get(mask)
        if support is None:
            support = self._supports[mask] = sum(w for i, w in enumerate(self._weights) if mask >> i & 1)
        return support

    def _capped(self, key: Hashable) -> float:
        """The key's vote, at most its resident parent's support (a dropped tail's parent
        bounds nothing)."""
        support = self._vote(key)
        parent = self._resident[key][1]
        if parent is not None and parent in self._support:
            bound = self._support[parent][0]
            if bound != TAIL and bound < support:
                return bound
        return support

    def _rate(self, key: Hashable, support: float | None = None, touch: bool = True) -> None:
        """(Re-)rate a resident key. ``touch``: it was just accessed (or inserted), so it is
        the most recent of its support; otherwise it keeps its place among its equals. Where
        its support moves, its resident children's cap moves with it, and so on down."""
        todo = [(key, support, touch)]
        while todo:
            key, support, touch = todo.pop()
            if support is None:
                support = self._capped(key)
            old = self._support.get(key)
            if touch or old is None:
                self._stamp += 1
                order = (self._prompt, -self._depth.get(key, 0), self._stamp)
            else:
                order = old[1]
            self._support[key] = (support, order)
            heapq.heappush(self._heap, (support, order, key))
            if old is None or old[0] != support:
                todo.extend((child, None, False) for child in self._children.get(key, ())
                            if self._support.get(child, (None,))[0] != TAIL)
        if len(self._heap) > 4 * len(self._support) + 64:  # mostly stale entries: compact
            self._compact()

    def _compact(self) -> None:
        self._heap = [(sup, order, k) for k, (sup, order) in self._support.items()]
        heapq.heapify(self._heap)

    def _drop_tail(self) -> None:
        tail, self._fresh = self._fresh, None
        held = None if tail is None else self._removed.get(tail)
        if tail is None or (tail not in self._resident and held is None):
            return
        for shadow in self._shadows:
            if tail in shadow.sizes:
                shadow.used -= shadow.sizes.pop(tail)
                shadow.policy.on_remove(tail, held=False)
        self._held.pop(tail, None)
        if held is None:
            self._rate(tail, TAIL)
            return
        hits, was_tail, size, parent = held  # held (copies queued, say): it comes back a tail
        self._reuse.on_return(tail, hits, was_tail)
        self._removed.put(tail, (self._reuse.on_leave(tail, True), True, size, parent))

    def _replay(self, key: Hashable, size: int, parent: Hashable | None, starts_prompt: bool = False) -> None:
        """One access in every shadow; re-rates the keys whose support it changed."""
        if starts_prompt and self._drop_tails:
            self._drop_tail()
        if parent is None:
            self._prompt += 1
        held, capacity = self._held, self.capacity_bytes
        mask = held.get(key, 0)
        touched: dict[Hashable, None] = {}  # other keys an expert evicted, in eviction order
        for bit, shadow, on_hit, on_miss, admit, on_insert, evict in self._steps:
            if mask & bit:
                shadow.window_hits += 1
                on_hit(key)
                continue
            on_miss(key)
            if admit is not None and not admit(key, size, parent):
                continue
            sizes = shadow.sizes
            sizes[key] = size
            shadow.used += size
            mask |= bit
            on_insert(key, size, parent)
            while shadow.used > capacity:
                victim = evict()
                shadow.used -= sizes.pop(victim)
                if victim == key:
                    mask &= ~bit
                    continue
                rest = held[victim] & ~bit
                if rest:
                    held[victim] = rest
                else:
                    del held[victim]
                touched[victim] = None
        if mask:
            held[key] = mask
        else:
            held.pop(key, None)
        resident = self._resident
        if key in resident:
            self._rate(key)
        for k in touched:
            if k in resident:
                self._rate(k, touch=False)
        self._accesses += 1
        if self._accesses == self._next_reweigh:
            self._next_reweigh += min(WINDOW, self._accesses)
            self._reweigh()

    def _reweigh(self) -> None:
        window, self._window_start = self._accesses - self._window_start, self._accesses
        self._gaps.add([shadow.window_hits / window for shadow in self._shadows])
        for shadow in self._shadows:
            shadow.score = (1 - SMOOTHING) * shadow.score + SMOOTHING * shadow.window_hits
            shadow.window_hits = 0
        best = max(s.score for s in self._shadows)
        if best <= 0:
            return
        weights = [min((s.score / best) ** SHARPNESS, self._gaps.standing(i)) for i, s in enumerate(self._shadows)]
        top = max(weights)
        weights = [w / top for w in weights] if top > 0 else weights
        if max(abs(a - b) for a, b in zip(weights, self._weights)) <= REWEIGH:
            return
        self._weights = weights
        self._supports = {}
        fresh = self._capped_supports()
        for key, (_, order) in self._support.items():
            self._support[key] = (fresh[key], order)
        self._compact()

    def _capped_supports(self) -> dict[Hashable, float]:
        """Every resident key's support for the current weights, parents before children (a
        dropped tail stays one)."""
        fresh: dict[Hashable, float] = {}
        for key in self._support:
            chain = []
            while key is not None and key in self._support and key not in fresh:
                chain.append(key)
                key = self._resident[key][1]
            bound = fresh.get(key, math.inf) if key is not None else math.inf
            for key in reversed(chain):
                if bound == TAIL:
                    bound = math.inf
                fresh[key] = bound = TAIL if self._support[key][0] == TAIL else min(self._vote(key), bound)
        return fresh

    def on_hit(self, key: Hashable) -> None:
        held = self._removed.get(key)
        if key in self._resident:
            self._reuse.on_hit(key, self._support[key][0] == TAIL)
            size, parent = self._resident[key]
        elif held is not None:  # removed by the owner but held (pinned, say): an access all the same
            hits, tail, size, parent = held
            self._reuse.on_return(key, hits, tail)  # it left after this hit, not before
            self._reuse.on_hit(key, tail)
            self._removed.put(key, (self._reuse.on_leave(key, False), False, size, parent))
        else:
            return
        self._replay(key, size, parent, starts_prompt=parent is None and self._parents_seen)
        self._fresh = None

    def on_miss(self, key: Hashable) -> None:
        self._removed.pop(key)  # not held after all: a later insertion is a new one

    def _link(self, key: Hashable, size: int, parent: Hashable | None) -> None:
        self._resident[key] = (size, parent)
        if parent is not None:
            self._children.setdefault(parent, set()).add(key)

    def on_insert(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        self._link(key, size, parent)
        self._depth[key] = 0 if parent is None else self._depth.get(parent, -1) + 1
        self._parents_seen = self._parents_seen or parent is not None
        handed_back = self._removed.pop(key)
        if handed_back is not None:  # unpinned, or copied: resident again, but not an access
            hits, tail, _, _ = handed_back
            self._reuse.on_return(key, hits, tail)
            self._rate(key, TAIL if tail else None)
            return
        self._replay(key, size, parent, starts_prompt=parent is None and self._parents_seen)
        self._fresh = key

    def _forget(self, key: Hashable) -> Hashable:
        tail = self._support[key][0] == TAIL
        self._last_victim = (key, self._reuse.on_leave(key, tail), tail)
        parent = self._resident.pop(key)[1]
        del self._support[key]
        siblings = self._children.get(parent)
        if siblings is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[parent]
        self._depth.pop(key, None)
        return key

    def evict(self) -> Hashable:
        heap, support = self._heap, self._support
        while heap:
            _, order, key = heapq.heappop(heap)
            if key in support and support[key][1] == order:
                return self._forget(key)
        raise LookupError("no resident key to evict")

    def reinstate(self, key: Hashable, size: int, parent: Hashable | None = None) -> None:
        """Resident again with the experts' current support; the shadows, which only model
        which keys are worth keeping, do not see it (it is not an access)."""
        self._link(key, size, parent)
        self._depth[key] = 0 if parent is None else self._depth.get(parent, -1) + 1
        if self._last_victim is not None and self._last_victim[0] == key:
            self._reuse.on_return(key, self._last_victim[1], self._last_victim[2])
        self._rate(key)

    def reuse_estimate(self, key: Hashable) -> float:
        """How likely the chunk is to be hit again, relative to chunks in general, from the
        class it is in (a dropped prompt tail, or 0, 1, 2+ hits so far; see ``ReuseClasses``).
        Asked of a resident key or the key ``evict`` just returned. A victim's vote support
        says nothing more: it is by construction the least in the cache."""
        if key in self._support:
            return self._reuse.estimate(self._reuse.hits.get(key, 0), self._support[key][0] == TAIL)
        if self._last_victim is not None and self._last_victim[0] == key:
            return self._reuse.estimate(self._last_victim[1], self._last_victim[2])
        return 1.0

    def victim_rank(self, key: Hashable) -> tuple | None:
        """The key's place in ``evict``'s heap: its support, then its order among equals."""
        return self._support.get(key)

    def on_remove(self, key: Hashable, held: bool = True) -> None:
        standing = None
        if key in self._resident:
            size, parent = self._resident[key]
            self._forget(key)
            _, hits, tail = self._last_victim
            standing = (hits, tail, size, parent)
        self._removed.removed(key, standing, held)

    def __len__(self) -> int:
        return len(self._resident)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._resident
