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
from dataclasses import dataclass
from typing import Sequence

from kvstore.keys import ROOT_HASH, ChunkKey, Namespace, chain_hash

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


@dataclass(frozen=True)
class SessionTail:
    """``num_blocks`` full engine blocks past the ``chunk`` leading full chunks of a session."""

    key: ChunkKey
    chunk: int  # index of the chunk the tail starts (= the session's full chunks)
    num_blocks: int

    def tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


def tail_key(namespace: Namespace, session: str, token_ids: Sequence[int], chunk: int, num_tokens: int,
             parent: ChunkKey | None) -> ChunkKey:
    """The key of ``token_ids[chunk * C : chunk * C + num_tokens]`` of ``session`` after ``parent``
    (the key of chunk ``chunk - 1``, None for the first)."""
    start = chunk * namespace.chunk_tokens
    h = chain_hash(parent.prefix_hash if parent is not None else ROOT_HASH, token_ids[start:start + num_tokens])
    return ChunkKey(session_namespace(namespace, session), h)


class TailRegistry:
    """The tail each paused session saved, for the connector's lookups (engine-local)."""

    def __init__(self, namespace: Namespace, block_size: int) -> None:
        self.namespace, self.block_size = namespace, block_size
        self._tails: dict[str, SessionTail] = {}

    def plan(self, session: str, token_ids: Sequence[int], num_kv_tokens: int,
             full_keys: Sequence[ChunkKey]) -> SessionTail | None:
        """The tail of a session whose first ``num_kv_tokens`` of ``token_ids`` have KV, or None
        when it ends on a chunk boundary or has less than one full block past it."""
        c = self.namespace.chunk_tokens
        chunk = num_kv_tokens // c
        blocks = (num_kv_tokens - chunk * c) // self.block_size
        if not session or blocks == 0 or len(full_keys) < chunk:
            return None
        parent = full_keys[chunk - 1] if chunk else None
        key = tail_key(self.namespace, session, token_ids, chunk, blocks * self.block_size, parent)
        return SessionTail(key, chunk, blocks)

    def remember(self, session: str, tail: SessionTail) -> SessionTail | None:
        """Record ``session``'s tail; returns the one it replaces (to delete), if any."""
        old = self._tails.get(session)
        self._tails[session] = tail
        return old if old is not None and old.key != tail.key else None

    def forget(self, session: str) -> SessionTail | None:
        return self._tails.pop(session, None)

    def get(self, session: str) -> SessionTail | None:
        return self._tails.get(session)

    def match(self, session: str, token_ids: Sequence[int], keys: Sequence[ChunkKey], chunk: int) -> SessionTail | None:
        """``session``'s tail if it starts at ``chunk`` and ``token_ids`` hold the same tokens
        there, after the same full chunks (``keys``: the request's full-chunk keys)."""
        tail = self._tails.get(session) if session else None
        if tail is None or tail.chunk != chunk or len(keys) < chunk:
            return None
        c = self.namespace.chunk_tokens
        if len(token_ids) < chunk * c + tail.tokens(self.block_size):
            return None
        parent = keys[chunk - 1] if chunk else None
        if tail_key(self.namespace, session, token_ids, chunk, tail.tokens(self.block_size), parent) != tail.key:
            return None
        return tail

    def __len__(self) -> int:
        return len(self._tails)
