"""The bytes each owner (a tenant) holds in each tier: what per-tenant quotas are checked
against.

The Store's index reports every replica it records and every one it removes (``added``,
``removed``: ``ChunkIndex.record``/``remove_replica``/``pop`` in kvstore/store/index.py), by key id
and tier. This ledger files them under the
key's namespace fingerprint (a key id's first 16 bytes) and counts them for the owner that
fingerprint was ``assign``ed to (the daemon assigns a namespace when a tenant first puts
into it or reads it; chunks recovered from disk before that count from then on), and keeps
each owner's quotas (``set_quotas``). It imports nothing of the Store and never calls back
into it: the Store's put and promotion paths keep an owner within its quotas, making room
among its own ``oldest`` chunks (kvstore/store/owner_quota.py).

A replica counts what it occupies in its tier once the tiers' footprints are known
(``measure``: host-RAM pages, disk blocks), not its blob bytes: before, a 192-byte blob
counted 192 bytes of a tenant's host quota while it held a 256 KiB page, and a tenant with
a 1 MiB quota filled a 16 MiB host tier.

``oldest`` lists them in the order they were recorded (a re-put moves a chunk to the end);
which leave first is the tier's eviction policy's to say. Thread-safe; the hooks take only this
ledger's lock, so they may be called under the Store's.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

from kvstore.keys import HASH_BYTES, Namespace


@dataclass
class _Replica:
    size: int  # blob bytes
    seq: int


class ReplicaUsage:
    """Bytes per tier and owner, for the tiers named (others are ignored)."""

    def __init__(self, tiers: Iterable[str]) -> None:
        self._lock = threading.Lock()
        self._seq = itertools.count()
        # tier -> fingerprint -> key id -> replica, oldest first
        self._replicas: dict[str, dict[bytes, OrderedDict[bytes, _Replica]]] = {t: {} for t in tiers}
        self._bytes: dict[str, Counter[bytes]] = {t: Counter() for t in self._replicas}  # per fingerprint
        self._owner: dict[bytes, str] = {}
        self._footprint: dict[str, Callable[[int], int]] = {}  # tier -> bytes a blob occupies there
        self._quotas: dict[str, dict[str, int]] = {}  # owner -> tier -> bytes it may hold there

    def measure(self, footprints: dict[str, Callable[[int], int]]) -> None:
        """Count each tier's replicas by ``footprints[tier](blob bytes)`` (page or block
        rounding) from now on, those recorded already included."""
        with self._lock:
            self._footprint.update(footprints)
            for tier, by_fp in self._replicas.items():
                for fp, replicas in by_fp.items():
                    self._bytes[tier][fp] = sum(self._cost(tier, r.size) for r in replicas.values())

    def _cost(self, tier: str, size: int) -> int:
        footprint = self._footprint.get(tier)
        return size if footprint is None else footprint(size)

    # -- hooks: the Store's replicas ---------------------------------------------------------

    def added(self, tier: str, key_id: bytes, nbytes: int) -> None:
        """``tier`` now holds ``nbytes`` for the key (a first copy, or a new encoding)."""
        by_fp = self._replicas.get(tier)
        if by_fp is None:
            return
        fp = key_id[:HASH_BYTES]
        with self._lock:
            replicas = by_fp.setdefault(fp, OrderedDict())
            old = replicas.pop(key_id, None)
            replicas[key_id] = _Replica(nbytes, next(self._seq))
            self._bytes[tier][fp] += self._cost(tier, nbytes) - (self._cost(tier, old.size) if old else 0)

    def removed(self, tier: str, key_id: bytes) -> None:
        by_fp = self._replicas.get(tier)
        if by_fp is None:
            return
        fp = key_id[:HASH_BYTES]
        with self._lock:
            replicas = by_fp.get(fp)
            old = replicas.pop(key_id, None) if replicas is not None else None
            if old is not None:
                self._bytes[tier][fp] -= self._cost(tier, old.size)
                if not replicas:
                    del by_fp[fp]
                    del self._bytes[tier][fp]

    # -- owners -------------------------------------------------------------------------------

    def assign(self, ns: Namespace, owner: str) -> None:
        """Count ``ns``'s chunks for ``owner`` from now on."""
        with self._lock:
            self._owner.setdefault(ns.fingerprint, owner)

    def set_quotas(self, owner: str, quotas: dict[str, int]) -> None:
        """The bytes ``owner`` may hold in each tier named (0: no bound), counted as ``used``
        counts them; the Store keeps an owner within them (kvstore/store/owner_quota.py)."""
        with self._lock:
            self._quotas[owner] = {t: n for t, n in quotas.items() if n and t in self._replicas}

    def quotas_of(self, key_id: bytes) -> tuple[str | None, dict[str, int]]:
        """The owner of the key's namespace and its quotas per tier ({}: none)."""
        with self._lock:
            owner = self._owner.get(key_id[:HASH_BYTES])
            return owner, dict(self._quotas.get(owner, {})) if owner is not None else {}

    def used(self, owner: str, tier: str) -> int:
        with self._lock:
            return sum(n for fp, n in self._bytes[tier].items() if self._owner.get(fp) == owner)

    def held(self, tier: str, key_id: bytes) -> int:
        """The bytes ``tier`` holds for the key, as counted (0: none)."""
        with self._lock:
            replicas = self._replicas[tier].get(key_id[:HASH_BYTES])
            replica = replicas.get(key_id) if replicas is not None else None
            return self._cost(tier, replica.size) if replica is not None else 0

    def footprint(self, tier: str, nbytes: int) -> int:
        """What a blob of ``nbytes`` would count in ``tier``."""
        with self._lock:
            return self._cost(tier, nbytes)

    def holds(self, tier: str, key_id: bytes) -> bool:
        with self._lock:
            replicas = self._replicas[tier].get(key_id[:HASH_BYTES])
            return replicas is not None and key_id in replicas

    def oldest(self, owner: str, tier: str, nbytes: int | None = None, at_least: int = 0,
               skip: bytes | None = None) -> list[tuple[bytes, int]]:
        """``owner``'s oldest recorded chunks in ``tier`` as (key id, bytes counted), oldest
        first, except ``skip``: enough to add up to ``nbytes`` and at least ``at_least`` of
        them (all of them for ``nbytes=None``, or when it holds less)."""
        with self._lock:
            fps = [fp for fp, o in self._owner.items() if o == owner and fp in self._replicas[tier]]
            runs = [((r.seq, key_id, r.size) for key_id, r in self._replicas[tier][fp].items()) for fp in fps]
            out, total = [], 0
            for _, key_id, size in heapq.merge(*runs):
                if nbytes is not None and total >= nbytes and len(out) >= at_least:
                    break
                if key_id != skip:
                    out.append((key_id, self._cost(tier, size)))
                    total += out[-1][1]
            return out

NO_USAGE = ReplicaUsage(())  # tracks nothing: the Store's default
