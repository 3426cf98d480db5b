"""``check_integrity``: the invariants that tie the index, the tiers, the policies, the
write-behind queues and the pins together, asserted all at once.

Tests call it after every scenario, and the property tests after every step, also while
copies are still being written: a key whose value is being changed (its mutation lock is
held, or a copy of it is queued) is only checked against the index, not against the tiers'
own books, and the tiers' totals only when nothing is in flight.
"""

from __future__ import annotations

import time
from typing import Mapping

from kvstore.store.index import ChunkIndex, KeyLocks
from kvstore.store.deletes import TierIO, peek_header
from kvstore.store.write_behind import WriteBehind
from tiers.base import Tier


def check_integrity(index: ChunkIndex, tiers: Mapping[str, Tier], write_behind: WriteBehind | None,
                    locks: KeyLocks, io: TierIO) -> None:
    """Raise AssertionError listing every invariant that does not hold."""
    problems: list[str] = []
    with index.lock:
        now = time.monotonic()
        index.expire_pins(now)
        busy = {key_id for _, key_id in locks.held()} | io.doomed()
        jobs: dict[bytes, int] = {}
        if write_behind is not None:
            for name, q in write_behind.queues.items():
                queued = list(q.waiting.values()) + list(q.running.values())
                if q.pending_bytes < sum(j.size for j in queued):
                    problems.append(f"{name}: queue counts {q.pending_bytes} pending bytes, its jobs {sum(j.size for j in queued)}")
                for job in queued:
                    busy.add(job.key_id)
                    if index.get(job.key_id) is job.entry:
                        jobs[job.key_id] = jobs.get(job.key_id, 0) + 1
        quiet = not busy and (write_behind is None or write_behind.pending_bytes() == 0)
        evictable = {name: 0 for name in index.policies}
        for key_id, entry in index.entries.items():
            where = key_id.hex()  # whole: the ids of one namespace share their first bytes
            if not entry.replicas and not entry.copying:
                problems.append(f"{where}: kept without a replica or a queued copy")
            if entry.copying != jobs.get(key_id, 0):
                problems.append(f"{where}: counts {entry.copying} copies queued, the queues hold {jobs.get(key_id, 0)}")
            if entry.pinned_until > now and entry.heap_until == 0.0:
                problems.append(f"{where}: pinned but not in the pin heap (its pin would never expire)")
            for name, replica in entry.replicas.items():
                tier = tiers[name]
                if tier.shared or key_id in busy:
                    continue
                if tier.size_of(key_id) != replica.size:
                    problems.append(f"{where}: index says {name} holds {replica.size} bytes, the tier says {tier.size_of(key_id)}")
                elif (replica.checksum is not None and (held := peek_header(tier, key_id)) is not None
                      and held.payload_checksum != replica.checksum):  # a damaged header is the read path's to find
                    problems.append(f"{where}: index says {name} holds the blob of payload checksum {replica.checksum:x}, "
                                    f"the tier holds another one")
            for name, policy in index.policies.items():
                want = index.evictable(name, entry, now)
                evictable[name] += want
                if (key_id in policy) != want:
                    problems.append(f"{where}: {name} policy {'lacks' if want else 'tracks'} it, though it is "
                                    f"{'' if want else 'not '}evictable there")
        for name, policy in index.policies.items():
            if len(policy) != evictable[name]:
                problems.append(f"{name}: policy tracks {len(policy)} keys, {evictable[name]} are evictable")
        for name, tier in tiers.items():
            if tier.shared:
                continue
            expected = 0
            for key_id in tier.keys():
                entry = index.get(key_id)
                if entry is None or name not in entry.replicas:
                    if key_id not in busy:
                        problems.append(f"{name}: holds {key_id.hex()}, which the index does not list there (an orphan)")
                    continue
                expected += tier.footprint(entry.replicas[name].size)
            if quiet and tier.used_bytes != expected:
                problems.append(f"{name}: uses {tier.used_bytes} bytes, its values' footprints add up to {expected}")
            if tier.used_bytes > tier.capacity_bytes:
                problems.append(f"{name}: uses {tier.used_bytes} of {tier.capacity_bytes} bytes")
    if problems:
        raise AssertionError("store integrity: " + "; ".join(problems))
