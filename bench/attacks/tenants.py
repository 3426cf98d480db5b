"""A tenant trying every RPC, on every path, against another tenant's keys: naming the
victim's tenant, no tenant, or its own, with the victim's prefix hashes. Nothing may come
back (no chunk, no count, no presence), nothing of the victim's may change."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from bench.attacks.target import NS, Target, content, keys
from kvstore.client import DaemonError


@dataclass
class TenantsReport:
    attempts: int = 0
    leaks: list[str] = field(default_factory=list)  # what came back that should not have
    victim_bad: int = 0

    def as_dict(self) -> dict:
        return {"attempts": self.attempts, "leaks": self.leaks, "victim_bad": self.victim_bad}


def run(target: Target) -> TenantsReport:
    report = TenantsReport()
    n = len(target.victim_keys)
    for claim in ("victim", "", "attacker", "system"):
        ns = dataclasses.replace(NS, tenant=claim)
        theirs = keys(0, n, ns)
        for transport in ("shm", "remote", "grpc"):
            with target.client("attacker", transport=transport, retries=0) as attacker:
                checks = {
                    "lookup": lambda: attacker.lookup(theirs) == 0,
                    "contains": lambda: not any(attacker.contains(k) for k in theirs[:4]),
                    "get": lambda: attacker.get(theirs) == [],
                    "get_into": lambda: not attacker.get_into(theirs[0], torch.empty(NS.chunk_shape, dtype=torch.float16)),
                    "get_blob": lambda: attacker.get_blob(theirs[0]) is None,
                    "pin": lambda: attacker.pin(theirs, 60) == 0,
                    "unpin": lambda: attacker.unpin(theirs) == 0,
                    "prefetch": lambda: attacker.prefetch(theirs, wait=True) == [],
                    "delete": lambda: attacker.delete(theirs) == 0,
                    "overwrite": lambda: _overwrite(attacker, theirs),
                }
                for name, check in checks.items():
                    report.attempts += 1
                    try:
                        if not check():
                            report.leaks.append(f"{name} claim={claim!r} via {transport}")
                    except DaemonError as exc:
                        if exc.code.name not in ("PERMISSION_DENIED",):  # the shared tenant, read-only
                            report.leaks.append(f"{name} claim={claim!r} via {transport}: {exc}")
    report.victim_bad = target.intact()
    return report


def _overwrite(attacker, theirs) -> bool:
    """A put under the victim's key lands in the attacker's own space (and is cleaned up)."""
    poison = torch.full(NS.chunk_shape, -1.0, dtype=torch.float16)
    attacker.put(theirs[0], poison)
    mine = attacker.get(theirs[:1])
    attacker.delete(theirs[:1])
    return len(mine) == 1 and torch.equal(mine[0], poison) and not torch.equal(poison, content(0))
