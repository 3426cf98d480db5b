"""Block-access traces for policy simulation: the Mooncake JSONL format and our own text format.

A trace is a list of requests; a request is the ordered list of its blocks' prefix-hash
ids (equal id = equal prefix). Formats, detected from the first non-blank character:

- Mooncake JSON Lines (``{"hash_ids": [...], ...}`` per line; other fields ignored);
- our text format: one request per line, integer block ids separated by spaces; ``#``
  starts a comment line.

Anything else is refused with the reason (a README is not a trace). The Azure LLM
inference CSVs are refused too: they hold arrival times and token counts but no block
hashes, so they say nothing about reuse (``kvbench engine --trace`` uses them for arrivals
and lengths).

Either may be gzip-compressed (detected from the magic bytes, not the name).
``synthetic:...`` names a generated trace (see ``bench.synthetic``), ``workload:...`` a
multi-tenant mix (``bench.workloads``), whose requests carry their tenant's kind.
"""

from __future__ import annotations

import gzip
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable


@dataclass
class Trace:
    name: str
    requests: list[list[Hashable]]
    classes: list[str] | None = None  # a label per request (its tenant's kind), where the trace has one
    distinct: int = field(init=False)
    accesses: int = field(init=False)

    def __post_init__(self) -> None:
        self.distinct = len({k for r in self.requests for k in r})
        self.accesses = sum(len(r) for r in self.requests)

    def head(self, n: int) -> "Trace":
        """The first ``n`` requests, for tests and quick looks."""
        return Trace(f"{self.name}[:{n}]", self.requests[:n], None if self.classes is None else self.classes[:n])


def _open_text(path: Path) -> io.TextIOBase:
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8")
    return open(path, encoding="utf-8")


AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


def _parse_line(line: str, lineno: int, path: Path) -> list[Hashable] | None:
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    if line.startswith(AZURE_HEADER):
        raise ValueError(f"{path}: an Azure LLM inference trace (arrival times and token counts, no block "
                         "hashes): it says nothing about reuse, so no cache can be replayed on it; "
                         "`kvbench engine --trace` uses it for arrivals and lengths")
    if line.startswith("{"):
        try:
            ids = json.loads(line)["hash_ids"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{lineno}: not a Mooncake record with hash_ids ({exc})") from None
        if not isinstance(ids, list):
            raise ValueError(f"{path}:{lineno}: hash_ids is not a list")
        return ids
    try:
        return [int(tok) for tok in line.split()]
    except ValueError:
        shown = line if len(line) <= 40 else line[:37] + "..."
        raise ValueError(f"{path}:{lineno}: not a trace: expected Mooncake JSON Lines or integer block ids "
                         f"separated by spaces, got {shown!r}") from None


def load_trace(spec: str) -> Trace:
    """Load ``spec``: a trace file path, ``synthetic:key=value,...`` or ``workload:NAME...``."""
    if spec.startswith("workload:"):
        from bench.workloads import generate_from_spec

        return generate_from_spec(spec)
    if spec.startswith("synthetic"):
        from bench.synthetic import generate_from_spec

        return generate_from_spec(spec)
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"no trace file {spec}")
    requests = []
    with _open_text(path) as f:
        try:
            for lineno, line in enumerate(f, 1):
                ids = _parse_line(line, lineno, path)
                if ids is not None:
                    requests.append(ids)
        except (UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:
            raise ValueError(f"{path}: unreadable trace ({exc})") from None
    if not requests:
        raise ValueError(f"{path}: no requests in trace")
    return Trace(path.name, requests)
