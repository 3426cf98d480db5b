"""``kvbench reuse``: when does a trace reuse a chunk, measured in capacities of traffic?

An eviction policy bets on when a chunk will be accessed next. This prints the bet's
ground truth: after a chunk's n-th access, the *hazard* of its next access at each age,
that is, of the chunks not accessed again yet at that age, the share accessed again within
the age bin, per capacity of traffic. Age counts block accesses since the chunk's latest
access, in units of the cache's capacity (``--capacity`` percent of the trace's distinct
blocks), so age 1 is one capacity's worth of traffic: roughly how long an LRU cache keeps
a chunk that is never hit.

A hazard that falls with age is what LRU assumes. A hazard that is near zero at small ages
and peaks later (users reading an answer before they send the next turn) means a small
cache cannot keep every new chunk long enough to see its reuse; it can only keep some.

A prompt's last chunk is counted apart from the others: it is usually partly filled, and
its hash changes when the next turn extends the prompt.
"""

from __future__ import annotations

import json
import math
import sys

from bench.cli import UsageError
from bench.sim import capacity_blocks
from bench.traces import Trace, load_trace

AGE_EDGES = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)  # capacities; the last bin is [32, inf)
CLASSES = ("1st, prompt's last chunk", "1st", "2nd", "3rd-4th", "5th+")


def _klass(nth: int, last_chunk: bool) -> int:
    if nth == 1:
        return 0 if last_chunk else 1
    return 2 if nth == 2 else 3 if nth <= 4 else 4


def reuse_hazard(trace: Trace, capacity: int) -> dict[str, dict[str, list[float] | int]]:
    """Per class of access: ``hazard`` per age bin (reuses per capacity of traffic among the
    chunks still waiting; NaN when none was observed through the bin), ``at_risk`` per bin
    and ``accesses`` (how many accesses of the class were followed through)."""
    times: dict = {}
    last_of_prompt = set()
    t = 0
    for request in trace.requests:
        for key in request:
            times.setdefault(key, []).append(t)
            t += 1
        if request:
            last_of_prompt.add(request[-1])
    end = t
    bins = len(AGE_EDGES)
    at_risk = [[0] * bins for _ in CLASSES]
    events = [[0] * bins for _ in CLASSES]
    counted = [0] * len(CLASSES)
    for key, ts in times.items():
        for n, start in enumerate(ts, 1):
            c = _klass(n, key in last_of_prompt)
            counted[c] += 1
            gap = (ts[n] - start) / capacity if n < len(ts) else math.inf
            observed = (end - start) / capacity
            for i, lo in enumerate(AGE_EDGES):
                hi = AGE_EDGES[i + 1] if i + 1 < bins else math.inf
                if gap < lo:
                    break
                if lo <= gap < hi:
                    at_risk[c][i] += 1
                    events[c][i] += 1
                    break
                if observed < hi != math.inf:  # the bin is cut off by the trace's end: not counted
                    break
                at_risk[c][i] += 1
    result = {}
    for c, name in enumerate(CLASSES):
        hazard = []
        for i in range(bins):
            width = AGE_EDGES[i + 1] - AGE_EDGES[i] if i + 1 < bins else math.inf
            if not at_risk[c][i]:
                hazard.append(math.nan)
            elif width == math.inf:
                hazard.append(events[c][i] / at_risk[c][i])  # the open bin: share reused at all
            else:
                hazard.append(events[c][i] / at_risk[c][i] / width)
        result[name] = {"hazard": hazard, "at_risk": at_risk[c], "accesses": counted[c]}
    return result


def format_table(result: dict) -> str:
    header = ["after access"] + [f"{lo:g}-{AGE_EDGES[i + 1]:g}" if i + 1 < len(AGE_EDGES) else f"{lo:g}+ (share)" for i, lo in enumerate(AGE_EDGES)] + ["accesses"]
    rows = [header]
    for name, r in result.items():
        cells = ["-" if math.isnan(h) else f"{h:.3f}" for h in r["hazard"]]
        rows.append([name, *cells, str(r["accesses"])])
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    return "\n".join("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))) for row in rows)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("reuse", help="when a trace reuses chunks: next-access hazard by age in capacities")
    p.add_argument("--trace", required=True, help="trace file (Mooncake JSONL or text, maybe gzipped) or synthetic[:k=v,...]")
    p.add_argument("--capacity", type=float, default=1.0, help="the capacity ages are counted in, percent of distinct blocks")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    if not 0 < args.capacity <= 100:
        raise UsageError(f"--capacity must be a percentage in (0, 100], got {args.capacity}")
    try:
        trace = load_trace(args.trace)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    blocks = capacity_blocks(trace, args.capacity)
    result = reuse_hazard(trace, blocks)
    print(f"{trace.name}: {trace.accesses} block accesses, {trace.distinct} distinct blocks; capacity {args.capacity:g}% = {blocks} blocks", file=sys.stderr)
    print("next-access hazard (reuses per capacity of traffic) by age in capacities since the access; last column: share reused after 32")
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            for r in result.values():
                r["hazard"] = [None if math.isnan(h) else round(h, 4) for h in r["hazard"]]
            json.dump({"trace": args.trace, "capacity_pct": args.capacity, "capacity_blocks": blocks, "age_edges": list(AGE_EDGES), "classes": result}, f, indent=2)
    return 0
