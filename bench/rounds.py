"""Interleaved rounds, and the medians `kvbench` prints from them.

This machine's speed drifts 2-4x within minutes (docs/benchmarks.md), so a single best figure
of ours against a single best figure of its limit says more about the moment each was taken
than about either. Every figure is therefore measured once per round, for ``ROUNDS`` rounds;
inside a round ours and its limit (or its baseline) are measured next to each other, the order
reversing every round (``in_turns``), so a slow moment weighs on both. A figure is printed as
its median over the rounds with the smallest and largest (``Spread``); a ratio is the median
of the per-round ratios (``ratio``), never a ratio of medians, so each pair compared saw the
same moment. The JSON keeps every round.

A limit stays the best configuration the machine offers at that moment: each round measures
every configuration (bench/limits.py) and keeps the best. A figure of ours more than
``NOISE`` above the limit of its own round means that limit is not the machine's
(``over_limit``): each command flags it, in its output and its JSON.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from bench.limits import NOISE, Limit

ROUNDS = 7

T = TypeVar("T")


def in_turns(round_index: int, *steps: Callable[[], T]) -> list[T]:
    """Every step run once, in the given order in even rounds and reversed in odd ones; the
    results in the given order. Which goes first alternates, so neither always meets the
    machine warmed (or tired) by the other."""
    order = range(len(steps)) if round_index % 2 == 0 else reversed(range(len(steps)))
    results: dict[int, T] = {}
    for i in order:
        results[i] = steps[i]()
    return [results[i] for i in range(len(steps))]


@dataclass(frozen=True)
class Spread:
    """One figure over the rounds: its median, smallest and largest."""

    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> "Spread":
        if not values:
            raise ValueError("no round was measured")
        return cls(statistics.median(values), min(values), max(values))

    @classmethod
    def from_dict(cls, d: dict) -> "Spread":
        """The spread in a dict that holds ``median``, ``min`` and ``max`` (among other keys)."""
        return cls(d["median"], d["min"], d["max"])

    def as_dict(self) -> dict:
        return {"median": self.median, "min": self.min, "max": self.max}

    def format(self, digits: int = 2) -> str:
        """``median (min-max)``."""
        return f"{self.median:.{digits}f} ({self.min:.{digits}f}-{self.max:.{digits}f})"


def ratio(ours: Sequence[float], base: Sequence[float]) -> Spread:
    """The per-round ratios ours / base, as a spread (its median is the median of the ratios)."""
    if len(ours) != len(base):
        raise ValueError("ours and its base must come from the same rounds")
    return Spread.of([a / b for a, b in zip(ours, base)])


def limit_summary(limits: Sequence[Limit]) -> dict:
    """A limit over the rounds, in the keys a single ``Limit.as_dict`` has (``gbps``,
    ``config``): the median of each round's best, the configuration that was best in most
    rounds, and the spread."""
    spread = Spread.of([limit.gbps for limit in limits])
    config = Counter(limit.config for limit in limits).most_common(1)[0][0]
    return {"gbps": spread.median, "config": config, **spread.as_dict()}


def over_limit(name: str, ours: Sequence[float], limits: Sequence[Limit]) -> list[dict]:
    """The rounds in which the figure ``name`` was above its round's limit by more than
    ``NOISE``: each proves that round's limit is not the machine's."""
    return [{"figure": name, "round": r, "gbps": gbps, "limit_gbps": limit.gbps, "limit_config": limit.config,
             "message": f"round {r}: {name} {gbps:.2f} GB/s exceeds the {limit.config} limit {limit.gbps:.2f} GB/s "
                        f"by more than {NOISE:.0%}: that limit is not the machine's"}
            for r, (gbps, limit) in enumerate(zip(ours, limits)) if gbps > limit.gbps * (1 + NOISE)]


def over_limit_lines(flags: list[dict]) -> list[str]:
    """What a command prints about ``over_limit``'s flags: one line saying none, or one a flag."""
    if not flags:
        return [f"over limit: none (no figure of ours above its round's limit by more than {NOISE:.0%})"]
    return [f"OVER LIMIT {f['message']}" for f in flags]
