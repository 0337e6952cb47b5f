"""The paged KV block pool: allocation, growth, free, and prefix caching with reference counts."""

from __future__ import annotations

import pytest

from trtc.runtime.core.block_manager import BlockManager
from trtc.runtime.core.sequence import Sequence

BS = 16
PREFIX = list(range(1000, 1064))  # 64 tokens = 4 full blocks


def computed(bm: BlockManager, seq: Sequence, num_tokens: int | None = None) -> Sequence:
    """Pretend a step computed the sequence's tokens up to ``num_tokens`` (default: all)."""
    num_tokens = seq.num_tokens if num_tokens is None else num_tokens
    assert bm.ensure_capacity(seq, num_tokens)
    seq.num_computed_tokens = num_tokens
    bm.cache_computed_blocks(seq)
    return seq


def admit(bm: BlockManager, seq: Sequence) -> Sequence:
    cached = bm.cached_prefix_blocks(seq)
    assert bm.allocate(seq, seq.num_tokens, cached)
    return seq


def test_allocate_grow_free():
    bm = BlockManager(num_blocks=10, block_size=BS)
    seq = Sequence("a", list(range(40)))  # 40 tokens -> 3 blocks
    assert bm.allocate(seq, 40)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 7
    assert bm.ensure_capacity(seq, 48)  # still fits block 3
    assert len(seq.block_table) == 3
    assert bm.ensure_capacity(seq, 49)
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 6
    assert not bm.ensure_capacity(seq, 49 + 7 * BS)  # needs 7 more, 6 free: nothing taken
    assert len(seq.block_table) == 4 and bm.num_free_blocks == 6
    assert bm.can_allocate(6) and not bm.can_allocate(7)
    bm.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_allocate_fails_without_side_effects():
    bm = BlockManager(num_blocks=3, block_size=BS)
    seq = Sequence("a", list(range(64)))
    assert not bm.allocate(seq, 64)
    assert seq.block_table == [] and bm.num_free_blocks == 3
    bm.check_invariants()


def test_shared_prefix_is_reused_across_sequences():
    bm = BlockManager(num_blocks=20, block_size=BS)
    a = admit(bm, Sequence("a", PREFIX + list(range(10))))
    assert a.num_computed_tokens == 0 and bm.prefix_cache_hits == 0
    computed(bm, a)
    assert bm.num_cached_blocks == 4  # the 5th block (10 tokens) is not full

    b = Sequence("b", PREFIX + list(range(50, 57)))
    cached = bm.cached_prefix_blocks(b)
    assert cached == a.block_table[:4]
    free_before = bm.num_free_blocks
    assert bm.allocate(b, b.num_tokens, cached)
    assert b.block_table[:4] == a.block_table[:4]  # shared ...
    assert b.block_table[4] not in a.block_table  # ... and its own tail
    assert all(bm.ref_counts[i] == 2 for i in a.block_table[:4])
    assert bm.ref_counts[a.block_table[4]] == 1
    assert bm.num_free_blocks == free_before - 1  # only the tail block was new
    assert b.num_computed_tokens == b.num_cached_prefix_tokens == 64
    assert bm.prefix_cache_hits == 64
    assert bm.prefix_cache_queries == a.num_tokens + b.num_tokens

    bm.free(a)
    assert all(bm.ref_counts[i] == 1 for i in b.block_table[:4])
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()

    # Freed, but still cached: a third sequence revives the blocks from the free queue.
    c = admit(bm, Sequence("c", PREFIX + [7]))
    assert c.block_table[:4] == cached and c.num_computed_tokens == 64
    assert bm.num_free_blocks == bm.num_blocks - 5
    bm.free(c)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_last_prompt_token_is_always_recomputed():
    bm = BlockManager(num_blocks=10, block_size=BS)
    computed(bm, admit(bm, Sequence("a", PREFIX)))
    b = admit(bm, Sequence("b", list(PREFIX)))  # the very same 64 tokens
    assert b.num_computed_tokens == 48  # 3 blocks: the last one holds the last token
    assert b.to_work(b.num_uncomputed_tokens).new_tokens == PREFIX[48:]


def test_block_is_registered_only_once_full_and_computed():
    bm = BlockManager(num_blocks=10, block_size=BS)
    a = admit(bm, Sequence("a", PREFIX))
    computed(bm, a, 40)  # blocks 0, 1 computed; block 2 half
    assert bm.num_cached_blocks == 2
    assert len(bm.cached_prefix_blocks(Sequence("x", PREFIX))) == 2
    computed(bm, a, 64)
    assert bm.num_cached_blocks == 4
    # Decode tokens that fill a block register it too.
    a.token_ids.extend(range(16))
    computed(bm, a, 80)
    assert bm.num_cached_blocks == 5
    bm.check_invariants()


def test_chain_hash_depends_on_the_whole_prefix():
    bm = BlockManager(num_blocks=10, block_size=BS)
    computed(bm, admit(bm, Sequence("a", PREFIX + [1])))
    # Same second block, different first block: no hit at all.
    other = Sequence("b", [0] * BS + PREFIX[BS:] + [1])
    assert bm.cached_prefix_blocks(other) == []
    # Diverges inside block 2: blocks 0 and 1 hit.
    diverging = Sequence("c", PREFIX[:40] + [-1] + PREFIX[41:] + [1])
    assert len(bm.cached_prefix_blocks(diverging)) == 2


def test_eviction_takes_least_recently_freed_first():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = computed(bm, admit(bm, Sequence("a", list(range(100, 164)) + [0])))  # 5 blocks, 4 cached
    b = computed(bm, admit(bm, Sequence("b", list(range(200, 232)) + [0])))  # 3 blocks, 2 cached
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 6
    # Two fresh blocks: the two unhashed tails go first, nothing cached is lost.
    c = Sequence("c", list(range(2 * BS)))
    assert bm.allocate(c, c.num_tokens)
    assert bm.num_cached_blocks == 6
    # Two more: a's blocks were freed first, tail first, so a's last two blocks are evicted.
    d = Sequence("d", list(range(500, 500 + 2 * BS)))
    assert bm.allocate(d, d.num_tokens)
    assert bm.num_cached_blocks == 4
    assert len(bm.cached_prefix_blocks(Sequence("a2", list(range(100, 164)) + [0]))) == 2
    assert len(bm.cached_prefix_blocks(Sequence("b2", list(range(200, 232)) + [0]))) == 2
    bm.check_invariants()


def test_reviving_cached_blocks_counts_against_the_pool():
    bm = BlockManager(num_blocks=5, block_size=BS)
    a = computed(bm, admit(bm, Sequence("a", PREFIX + [0])))
    bm.free(a)
    filler = Sequence("f", [9] * BS)
    assert bm.allocate(filler, BS)  # takes a's unhashed tail block
    b = Sequence("b", PREFIX + [1])
    cached = bm.cached_prefix_blocks(b)
    assert len(cached) == 4 and bm.num_free_blocks == 4
    # 4 revived + 1 fresh > 4 free: refused, and nothing changed.
    assert not bm.allocate(b, b.num_tokens, cached)
    assert b.block_table == [] and bm.num_free_blocks == 4 and bm.num_cached_blocks == 4
    bm.check_invariants()
    bm.free(filler)
    assert bm.allocate(b, b.num_tokens, cached)
    assert b.num_computed_tokens == 64
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_duplicate_blocks_computed_concurrently_stay_private():
    bm = BlockManager(num_blocks=12, block_size=BS)
    a = admit(bm, Sequence("a", PREFIX + [0]))
    b = admit(bm, Sequence("b", PREFIX + [0]))  # admitted before a computed anything: no hit
    assert b.num_computed_tokens == 0 and set(a.block_table).isdisjoint(b.block_table)
    computed(bm, a)
    computed(bm, b)
    assert bm.num_cached_blocks == 4
    assert bm.cached_prefix_blocks(Sequence("c", PREFIX + [0])) == a.block_table[:4]
    bm.check_invariants()
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=12, block_size=BS, enable_prefix_caching=False)
    computed(bm, admit(bm, Sequence("a", PREFIX + [0])))
    b = admit(bm, Sequence("b", PREFIX + [0]))
    assert b.num_computed_tokens == 0 and bm.num_cached_blocks == 0 and bm.prefix_cache_hits == 0


def test_bad_sizes():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(num_blocks=0, block_size=16)
