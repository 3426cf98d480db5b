"""The bytes each owner (a tenant) holds in each tier: what per-tenant quotas are checked
against.

The Store's index reports every replica it records and every one it removes (``added``,
``removed``: ``ChunkIndex.record``/``remove_replica``/``pop`` in kvstore/index.py), by key id
and tier. This ledger files them under the
key's namespace fingerprint (a key id's first 16 bytes) and counts them for the owner that
fingerprint was ``assign``ed to (the daemon assigns a namespace when a tenant first puts
into it; chunks recovered from disk before that count from then on). It imports nothing of
the Store and never calls back into it: the daemon enforces a quota itself, evicting the
``oldest`` chunks of a tenant over it before storing more.

Order is the order replicas were recorded (a re-put moves a chunk to the end): quotas evict
a tenant's oldest chunks first, whatever their reads. Thread-safe; the hooks take only this
ledger's lock, so they may be called under the Store's.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable

from kvstore.keys import HASH_BYTES, ChunkKey, Namespace


@dataclass
class _Replica:
    size: int
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
        self._namespaces: dict[bytes, Namespace] = {}

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
            self._bytes[tier][fp] += nbytes - (old.size if old else 0)

    def removed(self, tier: str, key_id: bytes) -> None:
        by_fp = self._replicas.get(tier)
        if by_fp is None:
            return
        fp = key_id[:HASH_BYTES]
        with self._lock:
            replicas = by_fp.get(fp)
            old = replicas.pop(key_id, None) if replicas is not None else None
            if old is not None:
                self._bytes[tier][fp] -= old.size
                if not replicas:
                    del by_fp[fp]
                    del self._bytes[tier][fp]

    # -- owners -------------------------------------------------------------------------------

    def assign(self, ns: Namespace, owner: str) -> None:
        """Count ``ns``'s chunks for ``owner`` from now on."""
        with self._lock:
            self._owner.setdefault(ns.fingerprint, owner)
            self._namespaces.setdefault(ns.fingerprint, ns)

    def used(self, owner: str, tier: str) -> int:
        with self._lock:
            return sum(n for fp, n in self._bytes[tier].items() if self._owner.get(fp) == owner)

    def held(self, tier: str, key_id: bytes) -> int:
        """The bytes ``tier`` holds for the key (0: none)."""
        with self._lock:
            replicas = self._replicas[tier].get(key_id[:HASH_BYTES])
            replica = replicas.get(key_id) if replicas is not None else None
            return replica.size if replica is not None else 0

    def holds(self, tier: str, key_id: bytes) -> bool:
        with self._lock:
            replicas = self._replicas[tier].get(key_id[:HASH_BYTES])
            return replicas is not None and key_id in replicas

    def oldest(self, owner: str, tier: str, nbytes: int, skip: frozenset[bytes] = frozenset()) -> list[ChunkKey]:
        """``owner``'s oldest chunks in ``tier`` that add up to at least ``nbytes`` (fewer if
        it holds less), except those in ``skip``."""
        with self._lock:
            fps = [fp for fp, o in self._owner.items() if o == owner and fp in self._replicas[tier]]
            runs = [((r.seq, key_id, r.size) for key_id, r in self._replicas[tier][fp].items()) for fp in fps]
            out, total = [], 0
            for _, key_id, size in heapq.merge(*runs):
                if total >= nbytes:
                    break
                if key_id in skip:
                    continue
                out.append(ChunkKey(self._namespaces[key_id[:HASH_BYTES]], key_id[HASH_BYTES:]))
                total += size
            return out


NO_USAGE = ReplicaUsage(())  # tracks nothing: the Store's default
