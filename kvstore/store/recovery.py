"""Rebuilding the index from the persistent tiers at start.

Every value a tier holds becomes a replica of its chunk, whatever its size: two tiers may
hold one chunk in different encodings (placement re-encoded one; a crash came between a
re-put's copies), and each is a whole, valid copy. Skipping one would leave bytes that
count against the tier but that nothing could ever evict (review #9). But only the copies
holding the blob found first (the same header) are the current version: the others may be
an older put's (a re-put's copy that reached one tier and failed on the other), and counted
current a later put of the first blob would skip them as done and a read could serve them.
They are stale replicas (``STALE``, kvstore/store/index.py): never read, evicted like any, replaced by the next
put's copy.

A private tier's values are checked at start by their headers (a read of 128 bytes each):
a zero-length or truncated file, which a power loss can leave under its final name when it
was written without fsync, or a file whose header is damaged or names another chunk, is
removed and counted, never reported present (review #15). Payloads are verified on read.
Once listed, a private tier's values are synced (``Tier.sync_all``, one call) and count as
synced: whether one was a durable put's is not known after a restart, and a copy that later
replaces it must not turn a durable file into one a power loss takes.
Shared tiers are only listed: their values belong to every daemon.
"""

from __future__ import annotations

import logging

from kvstore.store.deletes import peek_header
from kvstore.store.index import ChunkIndex
from tiers.base import Tier, TierError

log = logging.getLogger(__name__)


def recover(index: ChunkIndex, tier: Tier) -> None:
    """Add ``tier``'s values to the index (call before the Store serves)."""
    found = dropped = 0
    recovered = []  # (entry, replica)
    for key_id in tier.keys():
        size = tier.size_of(key_id)
        if size is None:
            continue
        header = None
        if not tier.shared:
            header = _header(tier, key_id, size)
            if header is None:
                try:
                    tier.delete(key_id)
                except TierError as exc:
                    log.warning("%s: cannot remove damaged %s: %s", tier.name, key_id.hex(), exc)
                dropped += 1
                continue
        entry = index.get(key_id)
        if entry is not None and header is None:  # a shared tier's value of a chunk found before:
            header = _header(tier, key_id, size)  # which blob is it? (a damaged one is nobody's)
        replica = index.recovered(key_id, tier.name, size, header, tier.shared)
        recovered.append((index.get(key_id), replica))
        found += 1
    if recovered and not tier.shared:
        try:
            tier.sync_all()
        except TierError as exc:
            log.warning("%s: cannot sync the values found at start (they count as unsynced): %s", tier.name, exc)
        else:
            for entry, replica in recovered:
                index.mark_synced(entry, tier.name, replica)
    index.count(tier.name, corruptions=dropped)
    if found or dropped:
        log.info("%s: recovered %d chunks (%d bytes)%s", tier.name, found, tier.used_bytes,
                 f"; removed {dropped} damaged or truncated" if dropped else "")


def _header(tier: Tier, key_id: bytes, size: int):
    """The value's blob header if it is whole and names ``key_id``; None otherwise."""
    header = peek_header(tier, key_id)
    if header is None or header.key_id != key_id or header.blob_len != size:
        return None
    return header
