"""Taking chunks out of the store on request: one tier's copies (``drop``) or every copy
(``delete``), for the Store's callers and for owners kept within their quotas
(kvstore/store/owner_quota.py).

The index forgets a copy first (under its lock) and the value is deleted after (TierIO), so
no read finds a copy whose file is going; queued copies of a deleted chunk are cancelled,
and a drop leaves alone a chunk whose copy is still being written from the tier dropped.
"""

from __future__ import annotations

from typing import Sequence

from kvstore.store.deletes import TierIO
from kvstore.store.index import ChunkIndex
from kvstore.store.write_behind import WriteBehind
from tiers.base import Tier, TierError, TierUnavailable


class Removal:
    def __init__(self, index: ChunkIndex, io: TierIO, write_behind: WriteBehind, tiers: dict[str, Tier]) -> None:
        self.index, self.io, self.write_behind, self.tiers = index, io, write_behind, tiers

    def drop(self, key_ids: Sequence[bytes], tier_name: str) -> int:
        """Remove one tier's copies (other replicas stay), after their queued copies are done;
        returns how many were removed. A chunk whose copy still waits on a stalled tier keeps
        its copy here (the copy's source): before, the drop waited for it with no bound, and
        a hung tier held every quota eviction's thread."""
        tier = self.tiers[tier_name]
        self.write_behind.wait_moving(list(key_ids))
        deletes = []
        with self.index.lock:
            for key_id in key_ids:
                entry = self.index.get(key_id)
                if entry is not None and tier_name in entry.replicas and not self.write_behind.busy(key_id):
                    self.index.remove_replica(key_id, entry, tier_name)
                    self.io.doom(tier_name, key_id)
                    deletes.append(key_id)
        for key_id in deletes:
            self.io.delete(tier, key_id)
        return len(deletes)

    def delete(self, key_ids: Sequence[bytes]) -> int:
        """Remove chunks from every tier; returns how many were present. Returns once their
        files are gone and no copy of them is being written any more (raises TierUnavailable
        naming the copies that stayed)."""
        deletes = []
        present = 0
        with self.index.lock:
            self.index.check_open()
            for key_id in key_ids:
                entry = self.index.get(key_id)
                if entry is None:
                    continue
                present += entry.readable()
                tiers = set(self.index.pop(key_id)) | set(self.write_behind.cancel(key_id, entry))
                for name in tiers:
                    self.io.doom(name, key_id)
                deletes.append((key_id, tiers))
        self._delete_values(deletes)
        return present

    def _delete_values(self, doomed: list[tuple[bytes, set[str]]]) -> None:
        """Delete each (key, tier names) value doomed already, then sync each tier's deletes,
        so a deleted chunk never comes back, not even after a power loss. Raises
        TierUnavailable naming the copies that stayed: a chunk is never reported deleted
        while a file of it stays (it would come back at restart)."""
        failed = []
        removed: dict[str, list[bytes]] = {}
        for key_id, names in doomed:
            for name in names:
                error = self.io.delete(self.tiers[name], key_id)
                if error is not None:
                    failed.append(f"{name}: {key_id.hex()}: {error}")
                removed.setdefault(name, []).append(key_id)
        for name, key_ids in removed.items():
            try:
                self.tiers[name].sync_deleted(key_ids)
            except TierError as exc:
                failed.append(f"{name}: syncing the deletes: {exc}")
        if failed:
            raise TierUnavailable(f"delete: {len(failed)} copies could not be removed ({'; '.join(failed[:3])})")
