"""Synthetic multi-tenant prefix workloads: a trace that no policy was tuned on.

Each request is a chain of prefix-hash block ids built from what it shares with others:

- every request starts with its tenant's system prompt (a few blocks per tenant);
- *document QA* requests then read a document from a corpus with Zipf popularity and ask
  a one-block question;
- *conversation* requests continue one of the open multi-turn conversations, whose
  history grows by a few blocks every turn (so each turn extends the previous prefix);
  a conversation ends after a geometric number of turns; with ``think`` > 0 its next turn
  waits a gamma-distributed (shape 2) number of requests with that mean: the user reads
  the answer and types, so a turn's chunks are rarely needed again right away, as in
  real chat traces (``kvbench reuse`` shows the difference);
- *one-off* requests carry unique content only;
- most requests end with a partly filled block, unique to the request, as real prompts do.

Ids are interned ``(parent id, content)`` pairs, so equal ids mean equal prefixes, exactly
like the hashes of the real traces. Everything is drawn from one seeded generator.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, fields
from typing import Hashable

from bench.traces import Trace


@dataclass
class SyntheticSpec:
    requests: int = 20000
    seed: int = 1
    tenants: int = 8
    system_blocks: int = 4
    docs: int = 2000
    doc_blocks: int = 12
    zipf: float = 1.0
    doc_share: float = 0.35  # fraction of requests that are document QA
    conv_share: float = 0.5  # fraction that are conversation turns; the rest are one-offs
    open_convs: int = 300  # conversations open at once
    mean_turns: float = 5.0
    turn_blocks: int = 3  # new history blocks per turn (at most)
    think: float = 0.0  # mean requests between two turns of a conversation (0: none)
    partial_tail: float = 0.9  # probability that a request ends with a partly filled block


def parse_spec(spec: str) -> SyntheticSpec:
    """``synthetic`` or ``synthetic:key=value,...`` with keys of ``SyntheticSpec``."""
    _, _, rest = spec.partition(":")
    types = {f.name: f.type for f in fields(SyntheticSpec)}
    values = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq or key not in types:
            raise ValueError(f"bad synthetic trace option {item!r}; known: {', '.join(types)}")
        try:
            values[key] = float(value) if types[key] in (float, "float") else int(value)
        except ValueError:
            raise ValueError(f"synthetic option {key} needs a number, got {value!r}") from None
    return SyntheticSpec(**values)


class Interner:
    """Prefix ids: one dense int per distinct (parent id, content) pair."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def chain(self, contents: list[Hashable]) -> list[int]:
        ids, parent = [], -1
        for content in contents:
            parent = self._ids.setdefault((parent, content), len(self._ids))
            ids.append(parent)
        return ids


def generate(spec: SyntheticSpec) -> list[list[int]]:
    rng = random.Random(spec.seed)
    interner = Interner()
    doc_cum = list(itertools.accumulate(1.0 / (rank + 1) ** spec.zipf for rank in range(spec.docs)))
    convs: list[dict] = []
    unique = 0
    requests = []
    for now in range(spec.requests):
        tenant = rng.randrange(spec.tenants)
        contents: list[Hashable] = [("sys", tenant, i) for i in range(spec.system_blocks)]
        kind = rng.random()
        if kind < spec.doc_share:
            doc = rng.choices(range(spec.docs), cum_weights=doc_cum)[0]
            contents += [("doc", doc, j) for j in range(spec.doc_blocks)]
            unique += 1
            contents.append(("q", unique))
        elif kind < spec.doc_share + spec.conv_share:
            ready = [c for c in convs if c["ready"] <= now] if spec.think > 0 else convs
            if len(convs) < spec.open_convs or not ready or rng.random() < 1 / spec.mean_turns:
                unique += 1
                conv = {"tenant": tenant, "history": [], "id": unique, "ready": 0}
                convs.append(conv)
            else:
                conv = ready[rng.randrange(len(ready))]
            if spec.think > 0:
                conv["ready"] = now + rng.gammavariate(2.0, spec.think / 2)
            contents = [("sys", conv["tenant"], i) for i in range(spec.system_blocks)]
            conv["history"] += [("conv", conv["id"], len(conv["history"]) + j) for j in range(rng.randint(1, spec.turn_blocks))]
            contents += conv["history"]
            if rng.random() < 1 / spec.mean_turns:
                convs.remove(conv)
        else:
            for _ in range(rng.randint(1, 2 * spec.doc_blocks)):
                unique += 1
                contents.append(("u", unique))
        if rng.random() < spec.partial_tail:
            unique += 1
            contents.append(("tail", unique))
        requests.append(interner.chain(contents))
    return requests


def generate_from_spec(spec: str) -> Trace:
    return Trace(spec, generate(parse_spec(spec)))
