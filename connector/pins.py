"""Which of this connector's requests hold which chunks pinned.

The store's pins are per chunk, not per holder (an ``unpin`` ends everybody's pin on the
chunk), so the connector counts holders itself: a chunk is unpinned when the last request
that looked it up has loaded it, finished or been preempted. The pin's lease bounds what a
crashed engine can leak."""

from __future__ import annotations

from kvstore.keys import ChunkKey


class PinLedger:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._held: dict[str, list[ChunkKey]] = {}

    def hold(self, request_id: str, keys: list[ChunkKey]) -> None:
        self._held.setdefault(request_id, []).extend(keys)
        for key in keys:
            self._holders.setdefault(key.id, set()).add(request_id)

    def release(self, request_id: str) -> list[ChunkKey]:
        """Forget ``request_id``'s pins; returns the chunks nobody holds any more (to unpin)."""
        free = []
        for key in self._held.pop(request_id, []):
            holders = self._holders.get(key.id)
            if holders is None:
                continue
            holders.discard(request_id)
            if not holders:
                del self._holders[key.id]
                free.append(key)
        return free

    def holders(self) -> set[str]:
        """Everyone holding a pin (request ids, and the session holders of engine/sessions.py)."""
        return set(self._held)

    def __len__(self) -> int:
        """Chunks held by at least one request."""
        return len(self._holders)
