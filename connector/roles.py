"""Producer and consumer roles for prefill-decode disaggregation through the store.

A producer (the prefill engine) saves every full chunk of a prompt durably, in the transfer
codec, and promises a consumer only the chunks whose puts returned: ``TransferParams``
(the keys, the tokens they cover, the first output token). A consumer (the decode engine)
never saves; it waits, with a bound, until the promised chunks are visible in its store,
then loads them like any other hit; whatever is not there by then it recomputes. Keys are
content addresses (namespace and token prefix), so a chunk the consumer loads is always the
KV of its own prompt under its own model: the worst a fault can do is a recompute.
See docs/disaggregation.md.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from connector.config import TransferConfig
from connector.metadata import ChunkSave
from connector.saver import Saver
from kvstore.api import ChunkStore
from kvstore.codecs import Codec, get_codec
from kvstore.codecs.mixed import MixedPrecisionCodec
from kvstore.keys import ChunkKey


@dataclass
class TransferParams:
    """What a producer hands the router once a prompt's puts returned (plain data: it crosses
    processes). ``key_ids`` (hex) are the leading full chunks promised, ``num_tokens`` the
    tokens they cover; ``first_token`` is the token the prefill sampled, or None when the
    consumer is to compute it (it started first, or the producer failed)."""

    request_id: str
    key_ids: list[str]
    num_tokens: int
    first_token: int | None = None
    codec: str = "raw"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransferParams":
        return cls(**d)


def sink_ranked(codec: MixedPrecisionCodec, sinks: int, recency: bool,
                attention: torch.Tensor | None = None) -> Codec:
    """``codec`` ranking rows by ``attention`` (``[layers, tokens]``, the prefill's observed
    attention), by recency (later tokens first) or by its own key norms, with the chunk's first
    ``sinks`` tokens (attention sinks: only a prompt's first chunk has them) on top."""

    def importance(keys: torch.Tensor) -> torch.Tensor:
        layers, tokens = keys.shape[:2]
        if attention is not None:
            score = attention.float().clone()
        elif recency:
            score = torch.arange(1, tokens + 1, dtype=torch.float32).expand(layers, tokens).clone()
        else:
            score = codec.importance(keys)
        if sinks:
            score[:, :sinks] = score.max() + 1
        return score

    return codec.with_importance(importance)


class TransferCodecs:
    """The codec a producer puts each chunk with: the configured one, re-ranked for mixed codecs."""

    def __init__(self, config: TransferConfig) -> None:
        base = get_codec(config.codec)
        self.name, self.sinks = config.codec, config.sink_tokens
        self._mixed = base if isinstance(base, MixedPrecisionCodec) else None
        if self._mixed is not None:
            recency = config.importance == "recency"
            self._root = sink_ranked(base, config.sink_tokens, recency)
            self._rest = sink_ranked(base, 0, recency) if recency else base
        else:
            self._root = self._rest = base

    def for_chunk(self, first: bool, attention: torch.Tensor | None = None) -> Codec:
        """For a prompt's first chunk (the one with the sink tokens) or any later one; a mixed
        codec ranks by ``attention`` (``[layers, chunk tokens]``) when it is given."""
        if attention is not None and self._mixed is not None:
            return sink_ranked(self._mixed, self.sinks if first else 0, False, attention)
        return self._root if first else self._rest


class ProducerSaver(Saver):
    """The saver of a producer: every put is durable and in the transfer codec, and chunks it
    failed to put are remembered until a durable put of theirs succeeds, so that they are
    never promised. Chunks the store holds already are put too: a copy in host RAM says
    nothing of the replica tier (a durable put whose copy failed leaves one), and a durable
    put of what is there only writes and syncs the copies it lacks."""

    skips_present = False

    def __init__(self, store: ChunkStore, pool, availability, stats, config: TransferConfig) -> None:
        super().__init__(store, pool, availability, stats)
        self.codecs = TransferCodecs(config)
        self._lost_ids: set[bytes] = set()
        self._attention: dict[bytes, torch.Tensor] = {}

    def rank(self, save: ChunkSave, attention: torch.Tensor) -> None:
        """The observed attention over ``save``'s tokens, ``[layers, chunk tokens]``, for its put."""
        with self._idle:
            self._attention[save.key.id] = attention

    def _put(self, items) -> None:
        try:
            super()._put(items)
        finally:  # put, skipped or lost: no ranking is kept
            with self._idle:
                for save, _ in items:
                    self._attention.pop(save.key.id, None)

    def _put_one(self, save: ChunkSave, buf: torch.Tensor) -> None:
        with self._idle:
            attention = self._attention.get(save.key.id)
        codec = self.codecs.for_chunk(save.parent is None, attention)
        self.store.put(save.key, buf, parent=save.parent, durable=True, codec=codec)
        with self._idle:
            self._lost_ids.discard(save.key.id)

    def _lost(self, saves: list[ChunkSave]) -> None:
        with self._idle:
            self._lost_ids.update(s.key.id for s in saves)

    def promised(self, keys: list[ChunkKey]) -> int:
        """How many leading ``keys`` may be promised (after ``flush``): held by the store, and
        none whose last put here failed. (Forgetting a lost chunk once asked about, as before,
        let the next request of the same prefix promise it: it saved nothing, its prefix was
        in its own KV cache, and lookup still found the failed put's copy in host RAM.)"""
        with self._idle:
            lost = [i for i, k in enumerate(keys) if k.id in self._lost_ids]
        held = self.store.lookup(keys) if keys else 0
        return min([held] + lost)


class PromisedChunks:
    """A consumer's bounded wait for one request's promised chunks.

    ``own`` are the consumer's keys of the prompt's full chunks. Promised ids that are not its
    own (another model, dtype, chunk size or tenant: another namespace) are never waited for:
    they could never become visible. ``ready()`` is true once every promised chunk is visible
    or the bound passed; a store that fails counts as not visible yet."""

    def __init__(self, store: ChunkStore, own: list[ChunkKey], params: TransferParams | None, wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.clock = store, clock
        promised = [bytes.fromhex(k) for k in params.key_ids] if params else []
        n = 0
        while n < min(len(promised), len(own)) and promised[n] == own[n].id:
            n += 1
        self.mismatched = n < len(promised)
        self.keys = own[:n]
        self.deadline = clock() + wait_s
        self.visible = 0
        self.timed_out = False

    def ready(self) -> bool:
        if self.visible < len(self.keys):
            try:
                self.visible = self.store.lookup(self.keys)
            except (ValueError, TypeError):
                raise
            except Exception:  # the store is down or restarting: not visible yet
                pass
        if self.visible >= len(self.keys):
            return True
        self.timed_out = self.clock() >= self.deadline
        return self.timed_out
