"""Hit-density statistics: how many hits per unit of cache time a key of a class and age earns.

The estimator behind our default policy (after Beckmann et al., "LHD", NSDI'18). For each
class of keys it keeps decayed histograms, over age buckets, of when keys were hit and
when they were evicted. A key's *hit density* at age ``a`` is the hits still expected
from keys of its class that reach age ``a``, divided by the cache time they will still
occupy. Keys with the lowest density are the cheapest to lose. Nothing is tuned to a
workload: the histograms learn the reuse-time distribution of whatever runs.

Ages are counted in accesses; buckets are geometric (four per octave) so short and long
reuse times are both resolved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXACT = 8  # ages below this have a bucket each
NUM_BUCKETS = EXACT + 4 * 28  # covers ages up to 2**31
DECAY = 0.9  # weight kept by old observations at each refresh


def age_bucket(age: int) -> int:
    if age < EXACT:
        return age
    n = age.bit_length()
    return min(NUM_BUCKETS - 1, EXACT + (n - 4) * 4 + (age >> (n - 3)) - 4)


def _bucket_start(b: int) -> int:
    if b < EXACT:
        return b
    n, t = (b - EXACT) // 4 + 4, (b - EXACT) % 4 + 4
    return t << (n - 3)


_STARTS = [_bucket_start(b) for b in range(NUM_BUCKETS)]
_MIDS = [(_STARTS[b] + (_STARTS[b + 1] if b + 1 < NUM_BUCKETS else 2 * _STARTS[b])) / 2 for b in range(NUM_BUCKETS)]


@dataclass
class HitDensity:
    classes: int
    hits: list[list[float]] = field(init=False)
    evictions: list[list[float]] = field(init=False)
    density: list[list[float]] = field(init=False)

    def __post_init__(self) -> None:
        self.hits = [[0.0] * NUM_BUCKETS for _ in range(self.classes)]
        self.evictions = [[0.0] * NUM_BUCKETS for _ in range(self.classes)]
        self.density = [[0.0] * NUM_BUCKETS for _ in range(self.classes)]

    def refresh(self) -> None:
        """Recompute every class's density curve, then age the observations."""
        for c in range(self.classes):
            hits, evictions, density = self.hits[c], self.evictions[c], self.density[c]
            cum_hits = cum_events = cum_event_time = 0.0
            for b in range(NUM_BUCKETS - 1, -1, -1):
                events = hits[b] + evictions[b]
                cum_hits += hits[b]
                cum_events += events
                cum_event_time += events * _MIDS[b]
                lifetime = cum_event_time - cum_events * _STARTS[b]
                density[b] = cum_hits / lifetime if lifetime > 0 else 0.0
                hits[b] *= DECAY
                evictions[b] *= DECAY
