"""A tier around another tier that passes every primitive through, for wrappers that change
a few of them (``tiers/throttle.py``'s bandwidth cap; the tests' fault injection).

The composite operations (``read_into_hashing``, ``write_sealed``) stay ``Tier``'s defaults,
built on ``read_into`` and ``write``: a wrapper that changes those changes them too, which
passing the inner tier's own composites through would silently skip.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from tiers.base import Buffer, Tier


class WrappedTier(Tier):
    def __init__(self, inner: Tier, name: str | None = None) -> None:
        super().__init__(name or inner.name, inner.capacity_bytes)
        self.inner = inner
        self.shared = inner.shared  # a class attribute would hide the wrapped tier's (review #18)
        self.budgeted = inner.budgeted

    def write(self, key: bytes, parts: Sequence[Buffer]) -> None:
        self.inner.write(key, parts)

    def read_into(self, key: bytes, out) -> int | None:
        return self.inner.read_into(key, out)

    def peek(self, key: bytes, nbytes: int) -> bytes | None:
        return self.inner.peek(key, nbytes)

    def sync(self, key: bytes) -> None:
        self.inner.sync(key)

    def sync_all(self) -> None:
        self.inner.sync_all()

    def delete(self, key: bytes) -> bool:
        return self.inner.delete(key)

    def sync_deleted(self, keys: Sequence[bytes]) -> None:
        self.inner.sync_deleted(keys)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def size_of(self, key: bytes) -> int | None:
        return self.inner.size_of(key)

    def keys(self) -> Iterator[bytes]:
        return self.inner.keys()

    @property
    def used_bytes(self) -> int:
        return self.inner.used_bytes

    def footprint(self, nbytes: int) -> int:
        return self.inner.footprint(nbytes)

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def close(self) -> None:
        self.inner.close()
