"""Finding chunks other daemons put in the shared tiers, for keys this index lacks.

With a shared index it is one Redis round trip; without one, an existence check per key and
shared tier, stopping at the first key no shared tier holds (a prefix cache needs nothing
after a gap). Found values become replicas whose codec is learnt on their first read.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.store.index import ChunkIndex
from kvstore.store.deletes import TierIO
from tiers.base import Tier, TierError


def discover(index: ChunkIndex, shared_tiers: Sequence[Tier], shared_index, key_ids: Sequence[bytes],
             io: TierIO | None = None) -> None:
    """Add the shared tiers' values of ``key_ids`` to the index. With ``io``, a value whose
    delete is decided and not done, or was done while this looked, is not listed: a lookup
    beside a ``delete`` must not bring the chunk back (the deleter would spare the file as a
    newer copy, or the index would list a file that is gone)."""
    if io is None:
        _discover(index, shared_tiers, shared_index, key_ids, None, 0)
        return
    with index.lock:
        mark = io.discovering()
    try:
        _discover(index, shared_tiers, shared_index, key_ids, io, mark)
    finally:
        with index.lock:
            io.discovered(mark)


def _discover(index: ChunkIndex, shared_tiers: Sequence[Tier], shared_index, key_ids: Sequence[bytes],
              io: TierIO | None, mark: int) -> None:
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
            if io is not None:
                where = {name: size for name, size in where.items()
                         if not (io.is_doomed(name, key_id) or io.removed_since(name, key_id, mark))}
                if not where:
                    continue
            index.discovered(key_id, where)
