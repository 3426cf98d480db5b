"""Tail chunks: the KV of a token sequence past its last full chunk.

Store keys name full chunks, so without tails a prompt of 2,000 tokens in 256-token chunks
recomputes its last 208 tokens on every hit, and that recompute dominates the hit. A tail is
the full engine blocks past the last full chunk, stored as one chunk blob (zero-padded to
the chunk's shape) under a key that chains over exactly those tokens from the last full
chunk's hash. A full chunk's key hashes ``chunk_tokens`` tokens and a tail's fewer, so the
two never collide; a tail is loaded only into a request whose tokens at those positions
are the same, after the same full chunks.

Two kinds share this shape: a prompt's tail, in the connector's own namespace (any request
with the same prefix may load it), saved once the prompt's prefill is done; and a paused
agent session's tail, in a namespace of the session's own (``connector/sessions.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kvstore.keys import ROOT_HASH, ChunkKey, Namespace, chain_hash


@dataclass(frozen=True)
class TailChunk:
    """``num_blocks`` full engine blocks past the ``chunk`` leading full chunks of a sequence."""

    key: ChunkKey
    chunk: int  # index of the chunk the tail starts (= the sequence's full chunks before it)
    num_blocks: int

    def tokens(self, block_size: int) -> int:
        return self.num_blocks * block_size


def tail_key(namespace: Namespace, token_ids: Sequence[int], chunk: int, num_tokens: int,
             parent: ChunkKey | None) -> ChunkKey:
    """The key of ``token_ids[chunk * C : chunk * C + num_tokens]`` after ``parent`` (the key
    of chunk ``chunk - 1``, None for the first), in ``namespace``."""
    if not 0 < num_tokens < namespace.chunk_tokens:
        raise ValueError(f"a tail holds 1 to {namespace.chunk_tokens - 1} tokens, not {num_tokens}")
    start = chunk * namespace.chunk_tokens
    h = chain_hash(parent.prefix_hash if parent is not None else ROOT_HASH, token_ids[start:start + num_tokens])
    return ChunkKey(namespace, h)


def plan_tail(namespace: Namespace, block_size: int, token_ids: Sequence[int], num_kv_tokens: int,
              full_keys: Sequence[ChunkKey]) -> TailChunk | None:
    """The tail of the first ``num_kv_tokens`` of ``token_ids`` (those with KV), or None when
    they end on a chunk boundary or have less than one full block past it. ``full_keys``: the
    keys of the sequence's full chunks, at least the ones before the tail."""
    chunk = num_kv_tokens // namespace.chunk_tokens
    blocks = (num_kv_tokens - chunk * namespace.chunk_tokens) // block_size
    if blocks == 0 or len(full_keys) < chunk:
        return None
    parent = full_keys[chunk - 1] if chunk else None
    return TailChunk(tail_key(namespace, token_ids, chunk, blocks * block_size, parent), chunk, blocks)


def tail_candidates(namespace: Namespace, block_size: int, token_ids: Sequence[int],
                    full_keys: Sequence[ChunkKey]) -> list[TailChunk]:
    """The prompt tails a request past its ``len(full_keys)`` full chunks could load, longest
    first: one per whole number of its blocks there (a conversation's next turn extends the
    tail an earlier turn saved)."""
    chunk = len(full_keys)
    longest = plan_tail(namespace, block_size, token_ids, len(token_ids), full_keys)
    if longest is None or longest.chunk != chunk:
        return []
    parent = full_keys[chunk - 1] if chunk else None
    return [longest] + [TailChunk(tail_key(namespace, token_ids, chunk, n * block_size, parent), chunk, n)
                        for n in range(longest.num_blocks - 1, 0, -1)]
