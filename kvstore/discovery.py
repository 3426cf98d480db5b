"""Finding chunks other daemons put in the shared tiers, for keys this index lacks.

With a shared index it is one Redis round trip; without one, an existence check per key and
shared tier, stopping at the first key no shared tier holds (a prefix cache needs nothing
after a gap). Found values become replicas whose codec is learnt on their first read.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.index import ChunkIndex, Entry, Replica
from tiers.base import Tier, TierError


def discover(index: ChunkIndex, shared_tiers: Sequence[Tier], shared_index, key_ids: Sequence[bytes]) -> None:
    found: dict[bytes, dict[str, int]] = {}
    if shared_index is not None:
        names = {t.name for t in shared_tiers}
        for key_id, where in shared_index.lookup(list(key_ids)).items():
            where = {n: size for n, size in where.items() if n in names}
            if where:
                found[key_id] = where
    else:
        for key_id in key_ids:
            where = {}
            for tier in shared_tiers:
                try:
                    size = tier.size_of(key_id)
                except TierError:
                    size = None
                if size is not None:
                    where[tier.name] = size
            if not where:
                break
            found[key_id] = where
    with index.lock:
        for key_id, where in found.items():
            entry = index.get(key_id)
            if entry is None:
                entry = index.entries[key_id] = Entry(0, next(iter(where.values())), None)
            for name, size in where.items():
                if name not in entry.replicas:
                    index.set_replica(key_id, entry, name, Replica(size, None, entry.version, found=True))
