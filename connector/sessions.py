"""Paused agent sessions, the store's half: their chunks pinned and prefetched, their tails.

The engine decides what a paused session's KV becomes (engine/sessions.py); what that means
for the store is here, behind ``KVConnector.pause_session`` / ``resume_session`` /
``unpin_session`` / ``end_session``.

A session's tail is its last, partial chunk. Store keys name full chunks of shared content,
so the KV past a session's last full chunk has no shared key. On a pause the full blocks of
that tail are saved as one chunk blob (zero-padded) under a key of the session's own
namespace: the connector's namespace with the tenant salted by the session id, so no other
session, and no other tenant, can ever compute the key. Its prefix hash chains over the
tail's tokens from the last full chunk, as a full chunk's would, so a tail is loaded only
into a request whose tokens at those positions are the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Sequence

from connector.availability import Availability
from connector.pins import PinLedger
from connector.tails import TailChunk, plan_tail, tail_key
from kvstore.api import ChunkStore, PausesSessions
from kvstore.keys import ChunkKey, Namespace, chunk_keys

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


@dataclass(frozen=True)
class SessionPins:
    """What a session holds pinned in the store after ``pause_session`` or ``resume_session``."""

    nbytes: int  # of the session's chunks (full ones and its tail) held pinned; 0: none
    missing: int = 0  # of them the store did not pin (still in the saver's queue, or the store is off)
    applied: bool = False  # False: nothing to pin (no chunk with KV, or the lease is over); nothing changed
    tail_saved: bool = False  # this pause saved the session's tail


class PausedSessions:
    """The store-facing half of paused agent sessions: their chunks pinned under the session's
    holder id (so the connector's lookups never unpin them), prefetched, and their tails saved
    and deleted. A store failure is the connector's outage, never the caller's."""

    def __init__(self, store: ChunkStore, namespace: Namespace, blocks_per_chunk: int, pins: PinLedger,
                 tails: TailRegistry, save_tail: Callable[[ChunkKey, list[int]], bool],
                 availability: Availability) -> None:
        self.store, self.namespace, self.blocks_per_chunk = store, namespace, blocks_per_chunk
        self.pins, self.tails, self._save_tail, self.availability = pins, tails, save_tail, availability
        self._keys: dict[str, list[ChunkKey]] = {}  # chunks held pinned, per session

    def pause(self, session: str, token_ids: Sequence[int], ttl_s: float,
              block_table: Sequence[int] | None = None) -> SessionPins:
        """With ``block_table`` (the session's device blocks), save its tail first; then pin
        every chunk of the first ``token_ids`` (those with KV) for ``ttl_s``."""
        saved = block_table is not None and self.save_tail(session, token_ids, block_table)
        return dataclasses.replace(self.pin(session, token_ids, ttl_s), tail_saved=saved)

    def resume(self, session: str, token_ids: Sequence[int]) -> int:
        """Bring the session's chunks up to the store's fastest tier; how many prefetches started."""
        keys = self._all_keys(session, token_ids)
        return self._each_namespace("prefetch", keys, lambda ks: len(self.store.prefetch(ks)))

    def pin(self, session: str, token_ids: Sequence[int], ttl_s: float) -> SessionPins:
        """Pin the session's chunks for ``ttl_s`` (extends, never shortens)."""
        keys = self._all_keys(session, token_ids)
        if not keys or ttl_s <= 0:
            return SessionPins(self._nbytes(session))
        holder, held = session_holder(session), self._keys.get(session, [])
        if not held:
            self.pins.hold(holder, keys)
        elif len(keys) > len(held):
            self.pins.hold(holder, [k for k in keys if k not in set(held)])
        self._keys[session] = keys
        if isinstance(self.store, PausesSessions):  # the daemon also learns the session, for resume_soon by id
            store = self.store
            pinned = self._each_namespace("pin", keys, lambda ks: store.pause(session, ks, ttl_s=ttl_s), len(keys))
        else:
            pinned = self._each_namespace("pin", keys, lambda ks: self.store.pin(ks, ttl_s), len(keys))
        return SessionPins(self._nbytes(session), max(0, len(keys) - pinned), applied=True)

    def save_tail(self, session: str, token_ids: Sequence[int], block_table: Sequence[int]) -> bool:
        """Save the blocks past the session's last full chunk as its tail; a tail it replaces
        is unpinned and deleted. False when there is none or the saver could not take it."""
        tail = self.tails.plan(session, token_ids, len(token_ids), chunk_keys(token_ids, self.namespace))
        if tail is None:
            return False
        start = tail.chunk * self.blocks_per_chunk
        if not self._save_tail(tail.key, list(block_table[start:start + tail.num_blocks])):
            return False
        replaced = self.tails.remember(session, tail)
        if replaced is not None:
            self.unpin(session)
            self._store("delete", lambda: self.store.delete([replaced.key]), None)
        return True

    def unpin(self, session: str) -> None:
        """Release the session's pins; its tail stays stored (its next turn's lookup finds it)."""
        if not self._keys.pop(session, None):
            return
        self._each_namespace("unpin", self.pins.release(session_holder(session)), self.store.unpin)

    def end(self, session: str) -> None:
        """Release the session's pins and delete its tail."""
        self.unpin(session)
        tail = self.tails.forget(session)
        if tail is not None:
            self._store("delete", lambda: self.store.delete([tail.key]), None)

    def _all_keys(self, session: str, token_ids: Sequence[int]) -> list[ChunkKey]:
        """The session's full chunks (the connector's own keys, so its lookups match), then its tail."""
        tail = self.tails.get(session)
        return chunk_keys(token_ids, self.namespace) + ([tail.key] if tail is not None else [])

    def _nbytes(self, session: str) -> int:
        return len(self._keys.get(session, ())) * self.namespace.chunk_bytes

    def _each_namespace(self, what: str, keys: list[ChunkKey], fn, default: int = 0) -> int:
        """``fn`` over ``keys`` one namespace at a time (a tail's is its own); the sum of its counts."""
        return sum(self._store(what, lambda: fn(group), default and len(group)) for group in by_namespace(keys))

    def _store(self, what: str, fn, default):
        if not self.availability.available():
            return default
        try:
            return fn()
        except (ValueError, TypeError):
            raise
        except Exception as exc:
            self.availability.failed(what, exc)
            return default
