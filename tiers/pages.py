"""The page table of a fixed-size-page pool, shared by the host-RAM and GPU tiers.

Why pages: chunks vary in size (codecs), and a general allocator fragments over time and
pays first-touch faults on fresh memory. A pool is allocated once and cut into pages; a
value occupies any free pages (a stack free list: O(1), and runs stay mostly contiguous),
the only waste being its last page's tail. Readers pin a value while they copy it, so a
value deleted or replaced meanwhile gives its pages back only when its last reader is done.

``PageTable`` only does the bookkeeping; ``PagedTier`` is the Tier side every paged tier
shares, and each tier owns its memory and does the copies.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

from tiers.base import Tier, TierFull


@dataclass
class PagedValue:
    pages: list[int]
    length: int
    runs: list[tuple[int, int]]  # (pool offset, length), in value order
    readers: int = 0
    dead: bool = False


def segments(runs: list[tuple[int, int]], sizes: list[int]) -> Iterator[tuple[int, int, int, int]]:
    """Pair a value's runs with buffers filled in order: (pool offset, buffer index, offset in
    that buffer, length) pieces."""
    index = offset = 0
    for start, length in runs:
        done = 0
        while done < length:
            while offset == sizes[index]:
                index, offset = index + 1, 0
            take = min(length - done, sizes[index] - offset)
            yield start + done, index, offset, take
            done += take
            offset += take


class PageTable:
    def __init__(self, name: str, capacity_bytes: int, page_bytes: int) -> None:
        if page_bytes <= 0:
            raise ValueError(f"{name}: page_bytes must be positive, got {page_bytes}")
        self.name = name
        self.page_bytes = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        if self.num_pages == 0:
            raise ValueError(f"{name}: capacity_bytes {capacity_bytes} is smaller than one page ({page_bytes})")
        self.pool_bytes = self.num_pages * page_bytes
        self._free = list(range(self.num_pages - 1, -1, -1))  # pop() yields ascending pages
        self._values: dict[bytes, PagedValue] = {}
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page_bytes)) * self.page_bytes

    @property
    def used_bytes(self) -> int:
        return (self.num_pages - len(self._free)) * self.page_bytes

    @property
    def free_bytes(self) -> int:
        return len(self._free) * self.page_bytes

    def allocate(self, length: int) -> PagedValue:
        """Pages for a new value of ``length`` bytes (not visible until ``publish``)."""
        npages = max(1, -(-length // self.page_bytes))
        with self._lock:
            if len(self._free) < npages:
                raise TierFull(f"{self.name}: need {npages} pages, {len(self._free)} free")
            pages = [self._free.pop() for _ in range(npages)]
        runs: list[tuple[int, int]] = []
        for i, page in enumerate(pages):
            take = min(self.page_bytes, length - i * self.page_bytes)
            offset = page * self.page_bytes
            if runs and runs[-1][0] + runs[-1][1] == offset:
                runs[-1] = (runs[-1][0], runs[-1][1] + take)
            else:
                runs.append((offset, take))
        return PagedValue(pages, length, runs)

    def discard(self, value: PagedValue) -> None:
        """Give back the pages of a value never published (its write failed)."""
        with self._lock:
            self._free.extend(reversed(value.pages))
            value.pages = []

    def publish(self, key: bytes, value: PagedValue) -> None:
        """Make a filled value visible under ``key``, retiring any value it replaces."""
        with self._lock:
            old = self._values.get(key)
            self._values[key] = value
            if old is not None:
                self._retire(old)

    def _retire(self, value: PagedValue) -> None:
        """Mark a value gone; its pages return now, or when its last reader is done (lock held).
        Pushed in reverse so that a re-allocation of the same size pops the same ascending run."""
        value.dead = True
        if value.readers == 0:
            self._free.extend(reversed(value.pages))
            value.pages = []

    @contextmanager
    def reading(self, key: bytes, capacity: int | None = None) -> Iterator[PagedValue | None]:
        """Pin a value for the ``with`` block (None if absent). With ``capacity``, raise
        ValueError if the value does not fit a caller's buffer of that size."""
        value = self.pin(key, capacity)
        if value is None:
            yield None
            return
        try:
            yield value
        finally:
            self.unpin(value)

    def pin(self, key: bytes, capacity: int | None = None) -> PagedValue | None:
        """``reading`` without a ``with`` block: the value stays pinned until ``unpin(value)``,
        called once."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                if capacity is not None and value.length > capacity:
                    raise ValueError(f"{self.name}: buffer of {capacity} bytes is too small for {value.length}")
                value.readers += 1
        return value

    def unpin(self, value: PagedValue) -> None:
        with self._lock:
            value.readers -= 1
            if value.dead and value.readers == 0:
                self._retire(value)

    def delete(self, key: bytes) -> bool:
        with self._lock:
            value = self._values.pop(key, None)
            if value is None:
                return False
            self._retire(value)
            return True

    def size_of(self, key: bytes) -> int | None:
        value = self._values.get(key)
        return None if value is None else value.length

    def __contains__(self, key: bytes) -> bool:
        return key in self._values

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def clear(self) -> None:
        with self._lock:
            self._values.clear()


class PagedTier(Tier):
    """The parts of the Tier interface that only consult the page table."""

    def __init__(self, name: str, capacity_bytes: int, page_bytes: int) -> None:
        super().__init__(name, capacity_bytes)
        self.table = PageTable(name, capacity_bytes, page_bytes)
        self.page_bytes = page_bytes

    def footprint(self, nbytes: int) -> int:
        return self.table.footprint(nbytes)

    @property
    def used_bytes(self) -> int:
        return self.table.used_bytes

    @property
    def free_bytes(self) -> int:
        return self.table.free_bytes

    def delete(self, key: bytes) -> bool:
        return self.table.delete(key)

    def contains(self, key: bytes) -> bool:
        return key in self.table

    def size_of(self, key: bytes) -> int | None:
        return self.table.size_of(key)

    def keys(self) -> Iterator[bytes]:
        return iter(self.table.keys())

    def __len__(self) -> int:
        return len(self.table)
