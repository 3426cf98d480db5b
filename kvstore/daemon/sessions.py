"""Paused agent sessions a daemon remembers: the chunks each one paused with, until when.

The engine knows which chunks an agent's history is; the agent framework knows when the
agent stalls on a tool and when it will be back. ``pause`` records a session's chunks (the
daemon pins them for the session's lease); ``resume`` names only the session and returns the
chunks to prefetch, so a framework can warm a session without knowing one key. Both are
advisory: an unknown or expired session is nothing to do. A record lives as long as its
lease and no longer, records are per owner (a tenant never sees another's sessions), and an
owner's book is bounded: past ``max_sessions`` its record expiring first goes, a record
keeps at most ``max_groups`` namespaces (a pause in one more drops the one recorded first;
before, one session paused in ever new namespaces grew without bound), and an owner's records
hold at most ``max_keys`` keys in all (past it, its other records go, the one expiring first
first, then the session's own namespaces recorded first: before, 300 pauses of 4,096 random
keys grew a daemon by 200 MiB in 19 s).

The lease rule (``pin_ttl``, TokenCake's: ``factor`` x the expected stall, within
``[low_s, high_s]``) is in kvstore/api.py. This module imports nothing of the project: keys are opaque, grouped
by the caller (one group per namespace, since one store call names one namespace).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

MAX_GROUPS = 64  # namespaces one session's record keeps (full chunks, tails, TP ranks, models)
MAX_KEYS = 262144  # keys one owner's records keep in all (~170 B each)


@dataclass
class _Paused:
    expires: float
    groups: dict[Hashable, list] = field(default_factory=dict)  # group (namespace) -> keys

    @property
    def keys(self) -> int:
        return sum(len(keys) for keys in self.groups.values())


class SessionBook:
    def __init__(self, max_sessions: int = 4096, clock: Callable[[], float] = time.monotonic,
                 max_groups: int = MAX_GROUPS, max_keys: int = MAX_KEYS) -> None:
        if max_sessions <= 0:
            raise ValueError(f"max_sessions must be positive, got {max_sessions}")
        if max_groups <= 0:
            raise ValueError(f"max_groups must be positive, got {max_groups}")
        if max_keys <= 0:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self.max_sessions, self.clock, self.max_groups, self.max_keys = max_sessions, clock, max_groups, max_keys
        self._lock = threading.Lock()
        self._by_owner: dict[str, dict[str, _Paused]] = {}

    def pause(self, owner: str, session: str, group: Hashable, keys: Sequence, lease_s: float) -> None:
        """Record ``keys`` as ``session``'s chunks of ``group`` (replacing what it had there),
        for ``lease_s`` from now at least (a lease extends, never shortens). More than
        ``max_keys`` are not recorded: the last ``max_keys`` are."""
        keys = list(keys)[-self.max_keys :]
        now = self.clock()
        with self._lock:
            book = self._live(owner, now)
            paused = book.get(session)
            if paused is None:
                if len(book) >= self.max_sessions:
                    del book[min(book, key=lambda s: book[s].expires)]
                paused = book[session] = _Paused(now + lease_s)
            paused.expires = max(paused.expires, now + lease_s)
            if group not in paused.groups and len(paused.groups) >= self.max_groups:
                del paused.groups[next(iter(paused.groups))]  # the namespace recorded first
            self._make_room(book, session, group, len(keys))
            paused.groups[group] = keys

    def _make_room(self, book: dict[str, _Paused], session: str, group: Hashable, nkeys: int) -> None:
        """Drop records until ``session``'s ``group`` fits ``max_keys`` with ``nkeys`` keys:
        other sessions', the one expiring first first, then ``session``'s other namespaces,
        the one recorded first first."""
        mine = book[session].groups
        held = sum(p.keys for p in book.values()) - len(mine.get(group, ()))
        others = sorted((s for s in book if s != session), key=lambda s: book[s].expires)
        while held + nkeys > self.max_keys and others:
            held -= book.pop(others.pop(0)).keys
        for other in [g for g in mine if g != group]:
            if held + nkeys <= self.max_keys:
                break
            held -= len(mine.pop(other))

    def resume(self, owner: str, session: str, lease_s: float) -> list[list]:
        """``session``'s keys, one list per group, its lease stretched to ``lease_s`` from now;
        [] if the session is unknown or its lease is over."""
        now = self.clock()
        with self._lock:
            paused = self._live(owner, now).get(session)
            if paused is None:
                return []
            paused.expires = max(paused.expires, now + lease_s)
            return [list(keys) for keys in paused.groups.values()]

    def forget(self, owner: str, session: str) -> bool:
        with self._lock:
            return self._by_owner.get(owner, {}).pop(session, None) is not None

    def __len__(self) -> int:
        now = self.clock()
        with self._lock:
            return sum(len(self._live(owner, now)) for owner in list(self._by_owner))

    def _live(self, owner: str, now: float) -> dict[str, _Paused]:
        """``owner``'s records, the expired ones dropped (the lock held)."""
        book = self._by_owner.setdefault(owner, {})
        for session in [s for s, p in book.items() if p.expires <= now]:
            del book[session]
        return book
