"""Keys an owner took out of a policy with ``on_remove`` and may hand back with ``on_insert``.

A Store removes a chunk from a tier's policy while it is held (pinned, being re-encoded,
or with copies to lower tiers queued) and inserts it again when the hold ends. That is
not a new chunk: the policy should take it back with the standing it had (ARC's list,
S3-FIFO's queue and frequency, ...), and count the hits it got meanwhile. A policy keeps
that standing here, per key, for at most ``REMEMBER_REMOVED`` keys (the oldest removed,
or touched, forgotten first): a forgotten key that comes back is a new insertion. A key
that left for good (``on_remove(key, held=False)``: deleted, dropped, corrupt) or that its
owner missed (``on_miss``) is forgotten at once.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Generic, Hashable, TypeVar

REMEMBER_REMOVED = 1 << 16  # removed keys remembered per policy

S = TypeVar("S")


class RemovedKeys(Generic[S]):
    """Bounded map from a removed key to the standing (not None) to hand it back with."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = REMEMBER_REMOVED if limit is None else limit
        self._keys: OrderedDict[Hashable, S] = OrderedDict()

    def put(self, key: Hashable, standing: S) -> None:
        """Remember ``key`` (again: a hit while held updates its standing) as the newest."""
        self._keys[key] = standing
        self._keys.move_to_end(key)
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)

    def get(self, key: Hashable) -> S | None:
        return self._keys.get(key)

    def hit(self, key: Hashable, promote: Callable[[S], S]) -> None:
        """A hit while held: the standing becomes ``promote(standing)``. Ignored for a key
        not removed (or forgotten)."""
        standing = self._keys.get(key)
        if standing is not None:
            self.put(key, promote(standing))

    def removed(self, key: Hashable, standing: S | None, held: bool) -> None:
        """Record an ``on_remove``: remember the ``standing`` of a key that was resident
        (None: it was not) while its owner holds it; forget the key if it left for good."""
        if not held:
            self._keys.pop(key, None)
        elif standing is not None:
            self.put(key, standing)

    def pop(self, key: Hashable) -> S | None:
        """The standing of a key handed back (now forgotten), or None for a key not removed."""
        return self._keys.pop(key, None)

    def __len__(self) -> int:
        return len(self._keys)
