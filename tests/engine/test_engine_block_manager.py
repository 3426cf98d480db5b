"""Block manager: reference counts, free list order, prefix caching with kvstore's chained hashes."""

import pytest

from engine.block_manager import BlockManager
from engine.sampling import SamplingParams
from engine.sequence import Sequence
from kvstore.keys import prefix_hashes


def seq(tokens):
    return Sequence(list(tokens), SamplingParams(max_tokens=4), arrival_time=0.0)


def computed(bm, s):
    """Pretend the model computed every token of ``s`` and publish its full blocks."""
    s.num_computed = len(s)
    bm.register_full_blocks(s)


def test_allocate_and_free_restore_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(10))
    assert bm.can_allocate(s)
    assert bm.allocate(s) == 0
    assert len(s.block_table) == 3 and bm.num_free == 5
    assert all(bm.blocks[b].ref_count == 1 for b in s.block_table)
    bm.free_seq(s)
    assert bm.num_free == 8 and s.block_table == []


def test_fresh_blocks_come_in_ascending_order_after_a_free():
    """free_seq puts a sequence's blocks back tail first, so taken in list order the next
    sequence would get them descending: every block its own copy in the connector."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(40))
    bm.allocate(a)
    computed(bm, a)
    bm.free_seq(a)
    bm.reset_prefix_cache()
    b = seq(range(100, 140))
    bm.allocate(b)
    assert b.block_table == sorted(b.block_table)
    assert set(b.block_table) <= set(range(16)) and len(b.block_table) == 10


def test_block_hashes_match_kvstore_chunk_hashes():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(100, 113))
    bm.allocate(s)
    computed(bm, s)
    assert s.block_hashes == prefix_hashes(list(range(100, 113)), 4)
    assert len(s.block_hashes) == 3  # the partial fourth block is not hashed


def test_prefix_hit_shares_blocks_and_keeps_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(range(12))
    bm.allocate(a)
    computed(bm, a)
    b = seq(list(range(8)) + [99, 98, 97])
    assert bm.allocate(b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.blocks[a.block_table[0]].ref_count == 2
    # an identical, block-aligned prompt reuses all but its last block: the last token is recomputed
    c = seq(range(12))
    assert bm.allocate(c) == 8
    assert c.num_uncomputed == 4


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=5, block_size=4)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    first, second = a.block_hashes
    bm.free_seq(a)
    assert bm.num_free == 5
    b = seq(range(9))
    assert bm.allocate(b) == 8  # both full blocks revived from the free list
    assert bm.num_free == 2
    bm.free_seq(b)
    # unhashed blocks go first, then the least recently freed: the tail block of the prefix
    c = seq(range(1000, 1013))
    bm.allocate(c)
    assert first in bm.cached and second not in bm.cached


def test_can_allocate_respects_watermark_and_revival_cost():
    bm = BlockManager(num_blocks=4, block_size=4, watermark_blocks=1)
    assert bm.can_allocate(seq(range(12)))
    assert not bm.can_allocate(seq(range(13)))
    resuming = seq(range(16))
    assert not bm.can_allocate(resuming)
    resuming.preempted = True  # a preempted sequence may resume into the watermark
    assert bm.can_allocate(resuming)


def test_append_slot_takes_a_block_only_at_block_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(range(4))
    bm.allocate(s)
    computed(bm, s)
    s.token_ids.append(7)
    assert bm.can_append(s)
    bm.append_slot(s)
    assert len(s.block_table) == 2
    s.token_ids.append(8)
    bm.append_slot(s)
    assert len(s.block_table) == 2


def test_prefix_caching_disabled_never_matches():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a = seq(range(9))
    bm.allocate(a)
    computed(bm, a)
    assert bm.allocate(seq(range(9))) == 0
    assert bm.cached == {}


def test_double_allocate_is_an_error():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(range(5))
    bm.allocate(s)
    with pytest.raises(ValueError, match="already holds blocks"):
        bm.allocate(s)
