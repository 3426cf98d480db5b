"""The Tier interface: one storage medium that moves opaque bytes by opaque key.

A tier knows nothing of chunk keys' meaning, codecs or policies. Keys are ``bytes`` (the
store uses a chunk key's 32-byte id). A tier never exceeds its capacity: a write that
does not fit raises ``TierFull`` and the owner evicts and retries.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from typing import Callable, Iterator, Protocol, Sequence

Buffer = bytes | bytearray | memoryview


def as_buffers(out: Buffer | Sequence[Buffer]) -> list[Buffer]:
    """``read_into``'s ``out`` as a list of buffers."""
    return list(out) if isinstance(out, (list, tuple)) else [out]


class TierError(Exception):
    """A tier could not do what was asked; the tier itself stays usable."""


class TierFull(TierError):
    """Not enough free capacity for this write."""

    pushback = True  # kvstore.api.pushed_back: the store is full now, not gone


class TierUnavailable(TierError):
    """The medium is gone or refuses I/O (directory removed, read-only, server down)."""


class SharedPool(Protocol):
    """A tier's memory as a pool other parties may read without a copy: a process that maps
    the backing file, or a socket sent bytes straight from its views. Ranges are (pool
    offset, length) pairs, valid while pinned."""

    path: str | None  # the file backing the pool, if other processes can map it

    def pinned_runs(self, key: bytes) -> AbstractContextManager[list[tuple[int, int]] | None]:
        """The value's ranges in order, kept allocated for the ``with`` block; None if absent."""

    def pin_runs(self, key: bytes) -> tuple[list[tuple[int, int]], Callable[[], None]] | None:
        """``pinned_runs`` without a ``with`` block: the ranges, and the call (to make once)
        that unpins them; None if absent."""

    def views(self, runs: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Views of pinned ranges, in this process."""

    def read_runs_into(self, runs: Sequence[Sequence[tuple[int, int]]], outs) -> None:
        """Each ``runs[i]`` (pinned ranges, in order) copied into ``outs[i]``, a buffer of
        their length, in one copy."""

    def register_with_cuda(self) -> bool:
        """Make the pool a source CUDA copies from by DMA (page-locked until the tier closes),
        once; whether it is."""


class Tier(ABC):
    # Whether other daemons read and write this medium too (a PFS, Redis): their chunks may
    # appear and vanish at any time, so a miss there is normal and the index is only a view.
    shared: bool = False
    # Whether the tier makes room itself, by ``make_room(need)``, for a budget kept outside this
    # process (a cluster's shared tier: kvstore/cluster/budgeted_tier.py); the Store's policy never evicts there.
    budgeted: bool = False
    # Whether ``write_sealed`` hashes the tier's own copy of the payload (not the source): only
    # then is a payload checked against its header as it is written exactly what is stored,
    # whatever its sender does to the source meanwhile (kvstore/blob.py, ``ClaimedBlob``).
    hashes_its_copy: bool = False

    def __init__(self, name: str, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"tier {name!r}: capacity_bytes must be positive, got {capacity_bytes}")
        self.name = name
        self.capacity_bytes = capacity_bytes

    @abstractmethod
    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        """Store the concatenation of ``parts`` under ``key``, replacing any old value.

        Atomic: a reader sees either the old value, nothing, or the whole new value.
        """

    def write_sealed(self, key: bytes, head_bytes: int, payload: Buffer, digest, seal: Callable[[], bytes]) -> None:
        """``write(key, [seal(), payload])``, where the ``head_bytes`` ``seal()`` returns depend on
        ``digest`` (``update``d with every payload byte, in order) and is called once the
        payload is in. A tier that copies the payload in updates ``digest`` on each slice it
        has just written, while it is in cache, so the bytes are read once, and the digest is
        of what the tier holds; this default reads them twice, and hashes the source. If
        ``seal()`` raises (the payload is refused), nothing is stored."""
        digest.update(payload)
        self.write(key, [seal(), payload])

    def read(self, key: bytes) -> Buffer | None:
        """The value's bytes (possibly a zero-copy view), or None if absent. This default
        reads into a new buffer of the recorded size; a file shorter than that reads short."""
        size = self.size_of(key)
        if size is None:
            return None
        buf = bytearray(size)
        got = self.read_into(key, memoryview(buf))
        return None if got is None else bytes(buf[:got])

    @abstractmethod
    def read_into(self, key: bytes, out: Buffer | Sequence[Buffer]) -> int | None:
        """Copy the value into ``out`` (one buffer, or several filled in order) and return its
        length; None if absent.

        Raises ValueError if ``out`` is too small.
        """

    def read_into_hashing(self, key: bytes, out: Buffer | Sequence[Buffer], head_bytes: int, digest) -> int | None:
        """``read_into``, with ``digest`` updated with every byte read past the first
        ``head_bytes``, in order. A tier that reads in slices hashes each as it lands, while
        it is in cache; this default reads, then hashes what it read."""
        got = self.read_into(key, out)
        if got is not None:
            offset = 0
            for o in as_buffers(out):
                view = memoryview(o).cast("B")
                lo, hi = max(head_bytes - offset, 0), min(got - offset, len(view))
                if lo < hi:
                    digest.update(view[lo:hi])
                offset += len(view)
        return got

    def peek(self, key: bytes, nbytes: int) -> bytes | None:
        """The value's first ``nbytes`` bytes (fewer if it is shorter), or None if absent: the
        Store checks blob headers at start without reading whole values. This default reads
        the whole value."""
        data = self.read(key)
        return None if data is None else bytes(memoryview(data)[:nbytes])

    def sync(self, key: bytes) -> None:
        """Make the value written under ``key`` survive a power loss (durable puts wait for it).
        Default: nothing to do, for tiers whose medium is volatile (RAM) or whose durability is
        the server's own setting (Redis persistence)."""

    def sync_all(self) -> None:
        """Make every value the tier holds now survive a power loss: called once at start, so
        the values found then count as synced, and a later copy that replaces one of a durable
        put is synced too. Default: nothing to do, as for ``sync``."""

    @abstractmethod
    def delete(self, key: bytes) -> bool:
        """Remove the value and give its space back; False if it was absent."""

    def sync_deleted(self, keys: Sequence[bytes]) -> None:
        """Make the deletes of ``keys`` survive a power loss (``Store.delete`` waits for it; an
        eviction does not: a value it removed coming back is only a cached chunk). Default:
        nothing to do, as for ``sync``."""

    @abstractmethod
    def contains(self, key: bytes) -> bool: ...

    @abstractmethod
    def size_of(self, key: bytes) -> int | None:
        """Stored length in bytes, or None if absent."""

    @abstractmethod
    def keys(self) -> Iterator[bytes]:
        """Every key held now (used to rebuild an index after a restart)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of capacity in use, including any per-value rounding."""

    def shared_pool(self) -> SharedPool | None:
        """This tier's memory as a ``SharedPool``, where it is one (host RAM); else None."""
        return None

    def footprint(self, nbytes: int) -> int:
        """Capacity a value of ``nbytes`` would use (page rounding, block rounding)."""
        return nbytes

    def close(self) -> None:
        """Release resources; the tier is unusable afterwards."""


class FirstTier(Tier):
    """The tier every put lands in (host RAM), whose copy of a chunk is the source of the
    copies written behind and of zero-copy reads: it lends its bytes in place."""

    @abstractmethod
    def pinned(self, key: bytes) -> AbstractContextManager[list[memoryview] | None]:
        """Views of the value's bytes in order, kept allocated for the ``with`` block even if
        the key is deleted or replaced meanwhile; None if absent."""

    @abstractmethod
    def shared_pool(self) -> SharedPool:
        """This tier's memory as a ``SharedPool``."""
