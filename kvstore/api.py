"""The ChunkStore contract: what a caller of the store (the connector first) may rely on.

Two implementations satisfy it: the in-process ``kvstore.store.Store`` and the daemon's
``kvstore.client.Client``; ``tests/test_api_conformance.py`` runs the same scenarios against
both (the daemon as a real process). Importing this module imports neither of them, so an
engine process that talks to a daemon never loads the Store, its tiers or its policies.

Rules every implementation keeps:

- Keys of one call share one namespace. A key of another namespace (model, dtype, chunk
  size, tenant...) names other chunks: it is a clean miss, never a load of foreign KV.
- ``lookup`` answers from an index (no chunk I/O) and counts *leading* keys present.
- Reads fill caller buffers: contiguous CPU tensors of the namespace's chunk shape and
  dtype (anything else is a ``ValueError``). A read fills the leading chunks it can and
  stops at the first miss; a corrupt or wrong-shaped blob is a miss, never returned.
  Once a read call returns, nothing writes its buffers any more.
- ``pin`` keeps present chunks from eviction for ``ttl_s`` seconds (it extends, never
  shortens, an earlier pin); the lease bounds any leak. Pins are per chunk, not per holder:
  one caller's ``unpin`` ends everybody's pin on that chunk.
- The last acknowledged ``put`` of a key is what reads return; putting the same blob again
  is a no-op. A put may wait while the store's write-behind queues are full (backpressure).
- Errors a caller can cause are ``ValueError``/``TypeError``; an unreachable store raises
  the implementation's own error (``DaemonError``, ``StoreClosed``, ``OSError``).

``put_blob`` is left out: the Store takes a ``ChunkKey`` or a key id of any namespace, the
Client a ``ChunkKey`` or the id of a namespace it has already used, so no caller can use it
through this contract alone.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Callable, Protocol, Sequence, runtime_checkable

import torch

from kvstore.keys import ChunkKey
from kvstore.wire.stats import StoreStats

# The lease on a paused agent session's chunks (TokenCake's rule, docs/agents.md): one rule for
# the engine's pauses and the daemon's session book.
PIN_FACTOR = 4.0
MIN_PIN_S = 60.0
MAX_PIN_S = 3600.0


def pin_ttl(stall_s: float, factor: float = PIN_FACTOR, low_s: float = MIN_PIN_S, high_s: float = MAX_PIN_S) -> float:
    """The lease on a paused session's chunks: ``factor`` x the stall, within [low_s, high_s]."""
    return min(high_s, max(low_s, factor * stall_s))


def valid_duration(seconds) -> float | None:
    """A duration from an event: a finite non-negative number, else None (unknown)."""
    try:
        seconds = float(seconds)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


@runtime_checkable
class ChunkStore(Protocol):
    def put(self, key: ChunkKey, kv: torch.Tensor, *, parent: ChunkKey | None = None,
            durable: bool = False, codec=None) -> None:
        """Store one chunk ``[layers, 2, chunk_tokens, kv_heads, head_dim]``; returns once it
        is in the first tier, or in every replica tier if ``durable``. ``codec``: a registered
        codec's name, or an instance of one (``kvstore.codecs.resolve_codec``); None: the default."""

    def lookup(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading keys are stored somewhere (index only, never chunk I/O)."""

    def contains(self, key: ChunkKey) -> bool:
        """Whether one chunk is stored."""

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        """Keep present chunks from eviction for ``ttl_s`` (> 0) seconds; returns how many were present."""

    def pin_leading(self, keys: Sequence[ChunkKey], ttl_s: float) -> int:
        """``lookup`` and ``pin`` in one step: pin the leading stored chunks (up to the first
        missing one) for ``ttl_s`` (> 0) seconds; returns how many. None of them can be evicted
        between being found and being pinned."""

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        """End pins early; returns how many of the keys were pinned."""

    def prefetch(self, keys: Sequence[ChunkKey]) -> list[Future]:
        """Start promoting chunks held only in slower tiers into the first; one future per promotion."""

    def get_into(self, key: ChunkKey, out: torch.Tensor) -> bool:
        """Load one chunk into ``out``; False on a miss (``out`` is then not meaningful)."""

    def get_many_into(self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor]) -> int:
        """Load the leading loadable chunks into ``outs`` (one buffer per key); returns how many."""

    def get(self, keys: Sequence[ChunkKey]) -> list[torch.Tensor]:
        """The leading loadable chunks, in fresh tensors."""

    def get_blob(self, key: ChunkKey) -> bytes | None:
        """One chunk's verified blob (header + encoded payload), or None on a miss."""

    def delete(self, keys: Sequence[ChunkKey]) -> int:
        """Remove chunks everywhere; returns how many were present."""

    def stats(self) -> StoreStats:
        """Counters of the store (in-process) or of the daemon's store."""

    def flush(self) -> None:
        """Wait until what this caller handed over is written where it is going."""

    def close(self) -> None:
        """Release this handle (the in-process Store flushes and stops; a Client disconnects)."""


@runtime_checkable
class LendsChunks(Protocol):
    """An optional capability (the in-process Store has it): ``borrow(key)`` is a context
    manager giving a read-only tensor of the chunk's shape over its bytes where they already
    lie raw, valid inside the ``with`` block, or None (then read with ``get_into``). A caller
    that copies the chunk somewhere anyway (the connector, into its paged cache) saves a copy."""

    def borrow(self, key: ChunkKey) -> AbstractContextManager[torch.Tensor | None]:
        ...

    def prepare_lending(self, device: torch.device | str) -> bool:
        """Make lent tensors a source ``device`` copies from directly (a CUDA device: by DMA,
        the store's host RAM page-locked for it); whether they are. Ask once, before lending."""
        ...


@runtime_checkable
class HandsOverChunks(Protocol):
    """An optional capability (the daemon's Client has it): ``get_with(keys, consume)`` calls
    ``consume(index, tensor)`` for each leading present chunk, with a read-only tensor valid
    only during that call (on the daemon's host, straight over its host pool); ``consume``
    returns False to take no more; returns how many it took. Like ``LendsChunks``, it saves a
    copy for a caller that copies the chunk somewhere anyway, across a process boundary."""

    def get_with(self, keys: Sequence[ChunkKey], consume: Callable[[int, torch.Tensor], bool]) -> int:
        ...

    def hands_over_in_place(self, device: torch.device | str = "cpu") -> bool:
        """Whether chunks are handed over from memory shared with the daemon as they are read
        (its host pool mapped here), not received whole per read call first (a remote daemon);
        for a CUDA ``device``, also whether that memory is a DMA source for it (registered
        with CUDA the first time this is asked)."""
        ...


@runtime_checkable
class PausesSessions(Protocol):
    """An optional capability (the daemon's Client has it): agent-session events the store
    keeps by session id (kvstore/daemon/sessions.py). ``pause`` pins ``keys`` (one namespace) like
    ``pin`` and remembers them under ``session``, so that ``resume_soon(session, eta_s)``,
    sent by whoever knows the agent is coming back (the engine, or the agent framework
    talking to the daemon directly), prefetches them without naming a key."""

    def pause(self, session: str, keys: Sequence[ChunkKey], expected_s: float | None = None,
              ttl_s: float | None = None) -> int:
        ...

    def resume_soon(self, session: str, eta_s: float = 0.0) -> int:
        ...


def pushed_back(exc: BaseException) -> bool:
    """Whether a store call failed because the store has no room or capacity for it right now
    (a first tier full of pinned or queued chunks, a daemon shedding load), not because the
    store is gone: a put to drop and count, not an outage. Implementations mark such errors
    with a true ``pushback`` attribute (tiers.base.TierFull, the Client's DaemonError for
    RESOURCE_EXHAUSTED)."""
    return bool(getattr(exc, "pushback", False))
