"""The paged KV block pool, with prefix caching.

A sequence's K/V live in fixed-size blocks; its ``block_table`` lists them in order. A *full,
computed* block is named by a chain hash, sha256(previous block's hash + its token ids), so the
hash of block i stands for the whole prefix up to the end of block i. A new sequence whose prompt
starts with known hashes shares those blocks (reference count + 1) and skips computing them.

Free blocks (reference count 0) wait in one queue, least recently freed first. A freed block keeps
its hash and can still be revived by a prefix hit, until the allocator takes it for new tokens
(eviction). Blocks without a hash hold nothing worth keeping, so they go to the front of the queue.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from trtc.runtime.core.sequence import Sequence


def chain_hash(prev_hash: bytes, token_ids: list[int]) -> bytes:
    # A cryptographic hash, so a hit can be trusted without comparing tokens (vLLM made the same
    # choice: with a weak hash one user's prompt could be made to collide with another's).
    return hashlib.sha256(prev_hash + array("q", token_ids).tobytes()).digest()


class BlockManager:
    """Pool of ``num_blocks`` KV blocks of ``block_size`` tokens.

    ``prefix_cache_queries`` / ``prefix_cache_hits`` count *tokens*: every admitted sequence adds
    its length to the queries and the tokens it got from the cache to the hits (a preempted
    sequence that is admitted again counts again).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"num_blocks={num_blocks} and block_size={block_size} must both be >= 1"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Per block, by id: how many sequences hold it, and its chain hash once it is full,
        # computed and registered. Two flat lists rather than an object a block: a pool of 200k
        # blocks is made in a millisecond instead of 0.2 s of a replica's start.
        self.ref_counts: list[int] = [0] * num_blocks
        self.hash_of_block: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- sizes ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still hold cached prefixes, reusable until
        evicted)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    # -- allocation ----------------------------------------------------------------------------

    def cached_prefix_blocks(self, seq: Sequence) -> list[int]:
        """The blocks of the longest cached prefix of ``seq``'s tokens (a lookup: changes nothing).
        Stops one token short of the end: the last token is always recomputed, so that the step
        has logits to sample from. A shared block is full and never written again (the decode
        attention reads earlier positions before waiting for the step's own cache writes:
        `trtc.plugins.paged_attention.triton_kernels`)."""
        if not self.enable_prefix_caching:
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for h in self._block_hashes(seq, num_full)[:num_full]:
            block_id = self.hash_to_block.get(h)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def allocate(
        self, seq: Sequence, num_tokens: int, cached_blocks: list[int] | tuple[int, ...] = ()
    ) -> bool:
        """Give a sequence that holds no blocks room for its first ``num_tokens`` tokens, sharing
        ``cached_blocks`` (from ``cached_prefix_blocks``, just before) and taking fresh blocks for
        the rest. Its computed tokens then start after the shared prefix. False, and nothing
        changed, when the pool is short."""
        assert not seq.block_table, f"{seq.request_id!r} already holds blocks"
        num_cached_tokens = len(cached_blocks) * self.block_size
        assert num_cached_tokens < num_tokens <= seq.num_tokens
        num_fresh = self.blocks_for(num_tokens) - len(cached_blocks)
        # A cached block nobody holds sits in the free queue: reviving it shrinks the pool too.
        num_revived = sum(1 for b in cached_blocks if self.ref_counts[b] == 0)
        if num_fresh + num_revived > len(self.free_queue):
            return False
        for block_id in cached_blocks:  # before taking fresh blocks, so none of them is evicted
            self._hold(block_id)
        seq.block_table = list(cached_blocks) + [self._take_free() for _ in range(num_fresh)]
        seq.num_checked_blocks = len(cached_blocks)  # registered already: they were hits
        seq.num_computed_tokens = seq.num_cached_prefix_tokens = num_cached_tokens
        self.prefix_cache_queries += seq.num_tokens
        self.prefix_cache_hits += num_cached_tokens
        return True

    def ensure_capacity(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to hold ``num_tokens`` tokens. False, and nothing changed,
        when the pool is short."""
        num_new = self.blocks_for(num_tokens) - len(seq.block_table)
        if num_new <= 0:
            return True
        if num_new > len(self.free_queue):
            return False
        seq.block_table.extend(self._take_free() for _ in range(num_new))
        return True

    def free(self, seq: Sequence) -> None:
        """Return ``seq``'s blocks; its K/V are gone from its point of view (computed tokens = 0).
        Blocks are released tail first, so a sequence's tail is evicted before its (more often
        shared) beginning."""
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_checked_blocks = 0

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Give back the blocks ``seq`` holds beyond its first ``num_tokens`` tokens (the slots
        of drafts its verification rejected). They were never registered in the prefix cache:
        only computed, verified tokens are hashed."""
        keep = self.blocks_for(num_tokens)
        while len(seq.block_table) > keep:
            self._release(seq.block_table.pop())

    # -- prefix cache --------------------------------------------------------------------------

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are now full and computed (call after each step;
        only the blocks filled since the last call are looked at: a step must not cost in
        proportion to its sequences' lengths). A block whose hash is already known (another
        sequence computed the same prefix at the same time) stays private and is not registered
        twice."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_checked_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_checked_blocks, num_full):
            block_id, h = seq.block_table[i], hashes[i]
            if self.hash_of_block[block_id] is None and h not in self.hash_to_block:
                self.hash_of_block[block_id] = h
                self.hash_to_block[h] = block_id
        seq.num_checked_blocks = num_full

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        """``seq``'s chain hashes, extended to cover at least its first ``num_full_blocks``
        blocks (tokens are only ever appended, so earlier hashes stay valid); its own list,
        not a copy, which may hold more."""
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            hashes.append(
                chain_hash(hashes[-1] if i else b"", seq.token_ids[i * bs : (i + 1) * bs])
            )
        return hashes

    # -- internals -----------------------------------------------------------------------------

    def _hold(self, block_id: int) -> None:
        if self.ref_counts[block_id] == 0:
            del self.free_queue[block_id]
        self.ref_counts[block_id] += 1

    def _release(self, block_id: int) -> None:
        self.ref_counts[block_id] -= 1
        assert self.ref_counts[block_id] >= 0, f"block {block_id} freed more often than held"
        if self.ref_counts[block_id] == 0:
            self.free_queue[block_id] = None
            if self.hash_of_block[block_id] is None:
                self.free_queue.move_to_end(block_id, last=False)

    def _take_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)  # least recently freed
        h = self.hash_of_block[block_id]
        if h is not None:  # evict: its cached prefix is lost
            del self.hash_to_block[h]
            self.hash_of_block[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def check_invariants(self) -> None:
        """Assert the pool is self-consistent (for tests and debugging)."""
        for block_id, (refs, h) in enumerate(zip(self.ref_counts, self.hash_of_block)):
            assert (refs == 0) == (block_id in self.free_queue), block_id
            if h is not None:
                assert self.hash_to_block.get(h) == block_id, block_id
        for h, block_id in self.hash_to_block.items():
            assert self.hash_of_block[block_id] == h
