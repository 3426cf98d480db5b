"""``kvbench policies``: replay a trace against eviction policies and Belady's OPT.

Prints, per capacity (percent of the trace's distinct blocks), every policy's hit ratio
(all hits / prefix-usable hits, % of block accesses) and how much of the LRU-to-OPT gap
in prefix-usable hits it closes. ``--json`` writes the same figures for other tools.
``--policies experts`` adds ``shadow-vote``'s experts run alone (``expert:NAME``) and a row
of ``shadow-vote`` minus the best of them, the bound it is meant to hold.
"""

from __future__ import annotations

import json
import sys
import time

from bench.cli import UsageError
from bench.sim import capacity_blocks, simulate, simulate_opt
from bench.traces import load_trace
from kvstore.policies import DEFAULT_POLICY, POLICIES, make_policy
from kvstore.policies.shadow_vote import EXPERT_POLICIES

OPT = "opt"
EXPERT = "expert:"
EXPERT_NAMES = [EXPERT + name for name in EXPERT_POLICIES]


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("policies", help="trace-driven eviction policy comparison")
    p.add_argument("--trace", required=True, help="trace file (Mooncake JSONL or text, maybe gzipped), synthetic[:k=v,...] or workload:NAME[:k=v,...]")
    p.add_argument("--capacities", default="1,2,5,10,20", help="capacities, percent of distinct blocks")
    p.add_argument("--policies", default=None, help=f"comma-separated; default: every policy and {OPT}")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.set_defaults(func=run)


def _parse_capacities(text: str) -> list[float]:
    try:
        caps = [float(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise UsageError(f"--capacities takes comma-separated percentages, got {text!r}") from None
    if not caps or any(not 0 < c <= 100 for c in caps):
        raise UsageError(f"--capacities must be percentages in (0, 100], got {text!r}")
    return [int(c) if c.is_integer() else c for c in caps]


def _parse_policies(text: str | None) -> list[str]:
    if text is None:
        return [*POLICIES, OPT]
    names = []
    for name in filter(None, (n.strip() for n in text.split(","))):
        name = DEFAULT_POLICY if name == "default" else name
        expanded = EXPERT_NAMES if name == "experts" else [name]
        for name in expanded:
            if name != OPT and name not in POLICIES and name not in EXPERT_NAMES:
                raise UsageError(f"unknown policy {name!r}; known: default, experts, {OPT}, "
                                 f"{', '.join(POLICIES)}, {', '.join(EXPERT_NAMES)}")
            if name not in names:
                names.append(name)
    if not names:
        raise UsageError("--policies names no policy")
    return names


def _policy(name: str, blocks: int):
    if name.startswith(EXPERT):
        return EXPERT_POLICIES[name.removeprefix(EXPERT)](blocks)
    return make_policy(name, blocks)


def experts_margin(results: dict, i: int) -> float | None:
    """``shadow-vote``'s prefix-usable hits minus the best of its experts' alone, at capacity index ``i``."""
    if "shadow-vote" not in results or not all(n in results for n in EXPERT_NAMES):
        return None
    return results["shadow-vote"]["prefix_hit"][i] - max(results[n]["prefix_hit"][i] for n in EXPERT_NAMES)


def measure(trace, names: list[str], capacities: list[float], progress=None) -> dict[str, dict[str, list[float]]]:
    """Hit and prefix-usable hit percentages for each policy at each capacity."""
    results = {name: {"hit": [], "prefix_hit": []} for name in names}
    for pct in capacities:
        blocks = capacity_blocks(trace, pct)
        for name in names:
            start = time.monotonic()
            r = simulate_opt(trace, blocks) if name == OPT else simulate(trace, _policy(name, blocks), blocks)
            results[name]["hit"].append(round(r.hit_pct, 2))
            results[name]["prefix_hit"].append(round(r.prefix_hit_pct, 2))
            if progress:
                progress(f"{pct}% ({blocks} blocks) {name}: {r.prefix_hit_pct:.2f}% prefix hits [{time.monotonic() - start:.1f}s]")
    return results


def gap_closed(results: dict, name: str, i: int) -> float | None:
    """Percent of the LRU-to-OPT prefix-hit gap that ``name`` closes at capacity index ``i``."""
    if "lru" not in results or OPT not in results:
        return None
    lru, opt = results["lru"]["prefix_hit"][i], results[OPT]["prefix_hit"][i]
    if opt - lru < 1e-9:
        return None
    return 100.0 * (results[name]["prefix_hit"][i] - lru) / (opt - lru)


def format_table(results: dict, capacities: list[float]) -> str:
    header = ["policy"] + [f"{c}%" for c in capacities]
    rows = [header]
    for name, r in results.items():
        cells = [name + (" (default)" if name == DEFAULT_POLICY else "")]
        for i in range(len(capacities)):
            cell = f"{r['hit'][i]:.2f} / {r['prefix_hit'][i]:.2f}"
            closed = gap_closed(results, name, i)
            if closed is not None and name not in ("lru", OPT):
                cell += f" ({closed:+.0f}%)"
            cells.append(cell)
        rows.append(cells)
    margins = [experts_margin(results, i) for i in range(len(capacities))]
    if None not in margins:
        rows.append(["shadow-vote minus best expert"] + [f"{m:+.2f}" for m in margins])
    widths = [max(len(row[j]) for row in rows) for j in range(len(header))]
    lines = ["  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    return "\n".join(lines)


def run(args) -> int:
    capacities = _parse_capacities(args.capacities)
    names = _parse_policies(args.policies)
    try:
        trace = load_trace(args.trace)
    except FileNotFoundError as exc:
        raise UsageError(str(exc)) from None
    print(f"{trace.name}: {len(trace.requests)} requests, {trace.accesses} block accesses, {trace.distinct} distinct blocks", file=sys.stderr)
    results = measure(trace, names, capacities, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"hit % / prefix-usable hit % of block accesses (LRU-to-OPT prefix gap closed); trace {trace.name}")
    print(format_table(results, capacities))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "capacities": capacities, "policies": results}, f, indent=2)
    return 0
