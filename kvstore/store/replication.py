"""Replication: which tiers below the first get a copy of a chunk (``replication.mode =
"utility"``; ``"all"`` copies every chunk to every replica tier).

Free-tier fetching reads a prefix from every tier that holds it at once, so a chunk with
copies in tiers S loads in about ``bytes / sum of S's bandwidths``, and without any in
``recompute_s``. A copy in tier T is worth, per use, the load time it saves over S:

    gain(T | S) = load_s(S) - load_s(S + T)          (load_s({}) = recompute_s)

and costs the bytes it takes there. While T has room those cost nothing; once T is full,
a copy displaces what T evicts next, worth about ``displaced x (recompute_s - load_s({T}))``
per use, where ``displaced`` is the expected reuse of T's recent victims (from its policy).
A chunk's first copy goes to the tier where it saves the most per byte, whatever it
displaces there: admission is that tier's eviction policy's business, and the estimates
of two policies (the first tier's of the new chunk, the lower tier's of its victims) are
not on one scale. Further copies are added greedily, the tier with the most net seconds
per byte first, while that is not negative: with room everywhere every tier gets a copy
(as ``"all"``); under pressure only a chunk expected to be reused enough that its extra
bandwidth is worth what the copy displaces. A chunk
read again from below the first tier is planned again with its reuse then, so it gains
copies as it proves hot. The module imports nothing of the project.
"""

from __future__ import annotations

from dataclasses import dataclass

DISPLACED_ALPHA = 0.05  # weight of the newest victim in a tier's displaced reuse


@dataclass(frozen=True)
class TierOption:
    name: str
    read_bytes_per_s: float
    footprint: int  # bytes of the tier's capacity the copy would take
    room: bool  # the copy fits without evicting anything
    displaced: float  # expected reuse of what a copy would displace (ignored with room)


def load_s(size: int, bandwidths: list[float], recompute_s: float) -> float:
    return size / sum(bandwidths) if bandwidths else recompute_s


def plan(reuse: float, size: int, recompute_s: float, have: dict[str, float], options: list[TierOption]) -> list[str]:
    """The tiers (of ``options``, none in ``have``: tier -> read bandwidth of copies the chunk
    already has) that should get a copy of a chunk of ``size`` bytes with expected ``reuse``."""
    chosen = dict(have)
    added: list[str] = []
    while True:
        now = load_s(size, list(chosen.values()), recompute_s)
        first = not chosen  # the first copy is ranked by what it saves alone
        best, best_rank = None, None
        for option in options:
            if option.name in chosen:
                continue
            gain = now - load_s(size, [*chosen.values(), option.read_bytes_per_s], recompute_s)
            displaced = 0.0 if option.room else option.displaced * max(0.0, recompute_s - size / option.read_bytes_per_s)
            net = (reuse * gain - displaced) / option.footprint
            rank = (reuse * gain / option.footprint,) if first else (net, reuse * gain / option.footprint)
            if gain > 0 and reuse > 0 and (first or net >= 0) and (best_rank is None or rank > best_rank):
                best, best_rank = option, rank
        if best is None:
            return added
        chosen[best.name] = best.read_bytes_per_s
        added.append(best.name)


class DisplacedReuse:
    """Per tier, a moving average of its victims' expected reuse: what a new copy there
    displaces. Starts at 1.0 (a typical chunk)."""

    def __init__(self) -> None:
        self._by_tier: dict[str, float] = {}

    def evicted(self, tier: str, reuse: float) -> None:
        old = self._by_tier.get(tier, 1.0)
        self._by_tier[tier] = old + DISPLACED_ALPHA * (reuse - old)

    def __getitem__(self, tier: str) -> float:
        return self._by_tier.get(tier, 1.0)
