"""The Store's counters as plain records: what ``stats()`` returns in-process, what the
daemon's Stats RPC carries and its metrics export. A client reads them without importing
the Store."""

from __future__ import annotations

from dataclasses import dataclass

EWMA_ALPHA = 0.2  # weight of the newest read in a tier's read_gbps


@dataclass
class TierStats:
    name: str
    capacity_bytes: int
    used_bytes: int = 0
    chunks: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    evictions: int = 0
    corruptions: int = 0
    errors: int = 0
    read_gbps: float = 0.0  # EWMA of recent reads' bandwidth
    recodes: int = 0  # copies placement re-encoded in place instead of evicting them
    lossy_hits: int = 0  # hits served from a lossy encoding


@dataclass
class StoreStats:
    tiers: dict[str, TierStats]
    chunks: int = 0
    puts: int = 0
    hits: int = 0
    misses: int = 0
    pinned: int = 0
    write_behind_pending_bytes: int = 0
    write_behind_queue: int = 0
    write_behind_dropped: int = 0
    recode_failures: int = 0  # placement re-encodes that failed or did not shrink; those copies were evicted
