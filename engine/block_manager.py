"""Paged KV block bookkeeping: reference counts, an O(1) LRU free list, and prefix caching.

Block ``i`` of a sequence holds tokens ``[i * block_size, (i + 1) * block_size)``. Once a
block is full and its KV computed, it is registered under the chained hash
``h_i = chain_hash(h_{i-1}, tokens of block i)`` (from ``ROOT_HASH``, as ``kvstore.keys``
does for store chunks, so a store chunk is exactly ``chunk_tokens / block_size`` blocks).
A freed block keeps its hash and stays findable until the free list hands it out again, so
a later request with the same prefix reuses it. A match never covers the last prompt token:
it must be recomputed to produce logits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engine.sequence import Sequence
from kvstore.keys import ROOT_HASH, chain_hash


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 watermark_blocks: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.watermark_blocks = watermark_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # ref-count-0 blocks, least recently freed first; hashed blocks can still be revived
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the leading full blocks of ``seq``, leaving at least one token to compute."""
        if not self.enable_prefix_caching:
            return []
        matched, parent = [], ROOT_HASH
        max_blocks = (len(seq) - 1) // self.block_size
        for i in range(max_blocks):
            parent = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            block_id = self.cached.get(parent)
            if block_id is None:
                break
            matched.append(block_id)
        return matched

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` the prefix cache holds now (what ``allocate`` would reuse)."""
        return len(self._match_prefix(seq)) * self.block_size

    def can_allocate(self, seq: Sequence, keep_free: int = 0) -> bool:
        """Whether all of ``seq``'s tokens fit while keeping the watermark free for running
        sequences to grow into (a preempted sequence resuming may use it), and ``keep_free``
        more blocks (memory reserved for others)."""
        matched = self._match_prefix(seq)
        revived = sum(1 for b in matched if self.blocks[b].ref_count == 0)
        fresh = self.blocks_needed(len(seq)) - len(matched)
        return self.num_free - revived - fresh >= (0 if seq.preempted else self.watermark_blocks) + keep_free

    def allocate(self, seq: Sequence) -> int:
        """Give ``seq`` blocks for all its tokens, reusing cached ones; returns tokens reused."""
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id} already holds blocks")
        matched = self._match_prefix(seq)
        parent = ROOT_HASH
        for block_id in matched:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            parent = block.hash
            seq.block_hashes.append(parent)
        # The free list decides which blocks; ascending ids make a chunk's blocks one run,
        # which the connector copies as a slice (kernels/block_copy.block_runs), not per block.
        seq.block_table += sorted(self._take_free() for _ in range(self.blocks_needed(len(seq)) - len(matched)))
        seq.num_computed = len(matched) * self.block_size
        return seq.num_computed

    def can_append(self, seq: Sequence) -> bool:
        return len(seq) <= len(seq.block_table) * self.block_size or self.num_free > 0

    def append_slot(self, seq: Sequence) -> None:
        """Make room for ``seq``'s newest token (one more block when the last is full)."""
        if len(seq) > len(seq.block_table) * self.block_size:
            seq.block_table.append(self._take_free())

    def register_full_blocks(self, seq: Sequence) -> None:
        """Publish ``seq``'s newly computed full blocks in the prefix cache."""
        full = seq.num_computed // self.block_size
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else ROOT_HASH
            h = chain_hash(parent, seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            if self.enable_prefix_caching and h not in self.cached:
                self.cached[h] = block.block_id
                block.hash = h

    def share(self, block_ids: list[int]) -> None:
        """One more reference on blocks somebody holds (an agent session keeping its KV on the
        device across a stall); ``release`` gives it back."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                raise ValueError(f"block {block_id} is free: only held blocks can be shared")
            block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; tail blocks first so they are the first to be reused."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
                if block.hash is None:
                    self.free.move_to_end(block_id, last=False)

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks first so they are the first to be reused."""
        self.release(seq.block_table)
        seq.block_table.clear()
        seq.block_hashes.clear()
        seq.num_computed = 0

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (the KV bytes stay, unreachable): later requests miss locally."""
        for block in self.blocks:
            if block.ref_count:
                raise RuntimeError("reset_prefix_cache with blocks in use")
            block.hash = None
        self.cached.clear()

    def check_integrity(self, holders: list[Sequence]) -> None:
        """Raise AssertionError unless the books balance for ``holders`` (every sequence that
        holds blocks): each block's reference count is its number of holders, the free list is
        exactly the unreferenced blocks, and the prefix cache maps each hash to a block that
        carries it. Cheap enough to call after every step in tests."""
        refs = [0] * len(self.blocks)
        for seq in holders:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id} holds a block twice"
            assert len(seq.block_table) * self.block_size >= seq.num_computed, f"{seq.request_id} computed past its blocks"
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], \
                f"block {block.block_id}: ref_count {block.ref_count}, held by {refs[block.block_id]}"
            assert (block.block_id in self.free) == (block.ref_count == 0), f"block {block.block_id} free list"
        for h, block_id in self.cached.items():
            assert self.blocks[block_id].hash == h, f"prefix cache entry of block {block_id} names another hash"

    def _take_free(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV blocks (the scheduler should have preempted)")
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None and self.cached.get(block.hash) == block_id:
            del self.cached[block.hash]
        block.hash = None
        block.ref_count = 1
        return block_id
