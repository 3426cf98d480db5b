"""Trace-driven cache simulation: replay a trace against a policy, or against Belady's OPT.

Every block occupies one unit (``BLOCK_SIZE``) and capacity is counted in blocks. Each
request accesses its blocks in order; a missed block is inserted if the policy admits
it, then the policy evicts until the blocks fit. Two hit counts are kept: every hit,
and *prefix-usable* hits, those before the request's first miss (an engine can only
load a prefix, so a hit after a miss saves nothing).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Hashable

from bench.traces import Trace
from kvstore.policies.base import EvictionPolicy

BLOCK_SIZE = 1


@dataclass
class SimResult:
    accesses: int
    hits: int
    prefix_hits: int

    @property
    def hit_pct(self) -> float:
        return 100.0 * self.hits / self.accesses if self.accesses else 0.0

    @property
    def prefix_hit_pct(self) -> float:
        return 100.0 * self.prefix_hits / self.accesses if self.accesses else 0.0


class InvariantError(AssertionError):
    """A policy broke the contract with its owner (found by ``simulate(check=True)``)."""


def capacity_blocks(trace: Trace, percent: float) -> int:
    """Capacity as a percentage of the trace's distinct blocks, at least one block."""
    return max(1, int(trace.distinct * percent / 100))


def simulate(trace: Trace, policy: EvictionPolicy, capacity: int, check: bool = False) -> SimResult:
    """Replay ``trace`` against ``policy`` holding at most ``capacity`` blocks.

    With ``check`` every step verifies the owner-side invariants (evicted keys were
    resident, capacity never exceeded, the policy's resident set matches the owner's).
    """
    resident: set[Hashable] = set()
    used = 0
    hits = prefix_hits = accesses = 0
    for request in trace.requests:
        usable = True
        parent = None
        for key in request:
            accesses += 1
            if key in resident:
                hits += 1
                if usable:
                    prefix_hits += 1
                policy.on_hit(key)
            else:
                usable = False
                policy.on_miss(key)
                if policy.admit(key, BLOCK_SIZE, parent):
                    resident.add(key)
                    used += BLOCK_SIZE
                    policy.on_insert(key, BLOCK_SIZE, parent)
                    while used > capacity:
                        victim = policy.evict()
                        if check and victim not in resident:
                            raise InvariantError(f"{policy.name} evicted non-resident {victim!r}")
                        resident.discard(victim)
                        used -= BLOCK_SIZE
            if check:
                if (key in policy) != (key in resident):
                    raise InvariantError(f"{policy.name} disagrees with its owner on whether {key!r} is resident")
                if used > capacity:
                    raise InvariantError(f"{policy.name} left {used} blocks in capacity {capacity}")
                if len(policy) != len(resident):
                    raise InvariantError(f"{policy.name} tracks {len(policy)} keys, {len(resident)} resident")
            parent = key
    return SimResult(accesses, hits, prefix_hits)


def simulate_opt(trace: Trace, capacity: int) -> SimResult:
    """Belady's OPT with bypass: keep the blocks whose next use comes soonest.

    Optimal for total hits when every block has the same size. A block is always used
    right after its parent, so OPT never keeps a block longer than its parent and its
    hits are prefix-usable too (counted anyway, not assumed). A block with no next use
    is dropped at once, which is what Belady would evict first anyway.
    """
    flat = [k for r in trace.requests for k in r]
    never = len(flat)
    next_use = [never] * never
    last: dict[Hashable, int] = {}
    for i in range(never - 1, -1, -1):
        next_use[i] = last.get(flat[i], never)
        last[flat[i]] = i
    resident: dict[Hashable, int] = {}  # key -> position of its next use
    heap: list[tuple[int, int]] = []  # (-next use, access position); stale entries skipped
    hits = prefix_hits = 0
    i = 0
    for request in trace.requests:
        usable = True
        for key in request:
            nxt = next_use[i]
            if resident.pop(key, None) is not None:
                hits += 1
                prefix_hits += usable
                keep = nxt < never
            else:
                usable = False
                keep = nxt < never
                if keep and len(resident) >= capacity:
                    while resident.get(flat[heap[0][1]]) != -heap[0][0]:
                        heapq.heappop(heap)
                    if -heap[0][0] > nxt:
                        del resident[flat[heapq.heappop(heap)[1]]]
                    else:
                        keep = False
            if keep:
                resident[key] = nxt
                heapq.heappush(heap, (-nxt, i))
            i += 1
    return SimResult(never, hits, prefix_hits)
