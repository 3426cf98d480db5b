"""Session-scoped tail chunks: the last, partial chunk of a paused agent session.

Store keys name full chunks of shared content, so the KV past a session's last full chunk
has no shared key. On a pause the engine saves the full blocks of that tail as one chunk
blob (zero-padded) under a key of the session's own namespace: the connector's namespace
with the tenant salted by the session id, so no other session, and no other tenant, can
ever compute the key. Its prefix hash chains over the tail's tokens from the last full
chunk, as a full chunk's would, so a tail is loaded only into a request whose tokens at
those positions are the same.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from connector.tails import TailChunk, plan_tail, tail_key
from kvstore.keys import ChunkKey, Namespace

SESSION_SALT = "\x1fsession\x1f"
SESSION_HOLDER = "\x1fsession\x1f"  # prefix of a paused session's holder id in the connector's PinLedger


def session_holder(session: str) -> str:
    return SESSION_HOLDER + session


def by_namespace(keys: Sequence[ChunkKey]) -> list[list[ChunkKey]]:
    """``keys`` grouped by namespace, in order: one store call may name only one (the daemon's
    Client refuses a mix), and a session's tail is in a namespace of its own."""
    groups: dict[Namespace, list[ChunkKey]] = {}
    for key in keys:
        groups.setdefault(key.namespace, []).append(key)
    return list(groups.values())


def session_namespace(namespace: Namespace, session: str) -> Namespace:
    """The namespace of ``session``'s tails: the tenant's, salted by the session id."""
    return dataclasses.replace(namespace, tenant=namespace.tenant + SESSION_SALT + session)


class TailRegistry:
    """The tail each paused session saved, for the connector's lookups (engine-local)."""

    def __init__(self, namespace: Namespace, block_size: int) -> None:
        self.namespace, self.block_size = namespace, block_size
        self._tails: dict[str, TailChunk] = {}

    def plan(self, session: str, token_ids: Sequence[int], num_kv_tokens: int,
             full_keys: Sequence[ChunkKey]) -> TailChunk | None:
        """The tail of a session whose first ``num_kv_tokens`` of ``token_ids`` have KV, or None
        when it ends on a chunk boundary or has less than one full block past it."""
        if not session:
            return None
        return plan_tail(session_namespace(self.namespace, session), self.block_size, token_ids, num_kv_tokens,
                         full_keys)

    def remember(self, session: str, tail: TailChunk) -> TailChunk | None:
        """Record ``session``'s tail; returns the one it replaces (to delete), if any."""
        old = self._tails.get(session)
        self._tails[session] = tail
        return old if old is not None and old.key != tail.key else None

    def forget(self, session: str) -> TailChunk | None:
        return self._tails.pop(session, None)

    def get(self, session: str) -> TailChunk | None:
        return self._tails.get(session)

    def match(self, session: str, token_ids: Sequence[int], keys: Sequence[ChunkKey], chunk: int) -> TailChunk | None:
        """``session``'s tail if it starts at ``chunk`` and ``token_ids`` hold the same tokens
        there, after the same full chunks (``keys``: the request's full-chunk keys)."""
        tail = self._tails.get(session) if session else None
        if tail is None or tail.chunk != chunk or len(keys) < chunk:
            return None
        c = self.namespace.chunk_tokens
        if len(token_ids) < chunk * c + tail.tokens(self.block_size):
            return None
        parent = keys[chunk - 1] if chunk else None
        if tail_key(tail.key.namespace, token_ids, chunk, tail.tokens(self.block_size), parent) != tail.key:
            return None
        return tail

    def __len__(self) -> int:
        return len(self._tails)
