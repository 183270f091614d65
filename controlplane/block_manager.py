"""Paged KV-cache accounting with prefix caching by chained xxhash.

The control plane decides every block and slot; the data plane only stores K/V
where it is told. A full block whose tokens are computed gets a hash chained
from the previous block's hash, so equal hashes mean equal prefixes. A block
whose reference count drops to zero goes back to the free list *with* its hash:
it can be reused by a later request with the same prefix until a new
allocation evicts it (least recently freed first).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import xxhash

from twinplane.controlplane.sequence import Sequence


def chain_hash(token_ids: list[int], prefix_hash: int | None) -> int:
    """Hash of one block's tokens, chained to the hash of the blocks before it."""
    h = xxhash.xxh64()
    if prefix_hash is not None:
        h.update(prefix_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int32).tobytes())
    return h.intdigest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None  # set once the block is full and computed
    token_ids: list[int] = field(default_factory=list)  # kept to verify a hash hit


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0, "need at least one block of at least one token"
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block_id: dict[int, int] = {}
        # Free blocks in the order they should be handed out (oldest freed first).
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache -------------------------------------------------------------------

    def looks_up(self, seq: Sequence) -> bool:
        """Whether seq's prefix is looked up in the cache (not without prefix caching, nor for a sequence
        that wants its prompt's log-probabilities)."""
        return self.enable_prefix_caching and seq.prompt_logprobs is None

    def find_cached_blocks(self, seq: Sequence) -> list[int]:
        """Blocks holding a computed prefix of seq's tokens (pure: changes nothing).

        At least the last token is always left to compute, so that the step that
        computes it can sample. A sequence that wants its prompt's log-probabilities computes
        the whole prompt: a cached position has no logits.
        """
        if not self.looks_up(seq):
            return []
        hits: list[int] = []
        prefix_hash = None
        for i in range((seq.num_tokens - 1) // self.block_size):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            prefix_hash = chain_hash(tokens, prefix_hash)
            block_id = self.hash_to_block_id.get(prefix_hash)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, seq: Sequence, num_known: int) -> None:
        """Hashes seq's blocks below num_known (tokens known and their K/V written), making them reusable."""
        num_full = num_known // self.block_size
        for i in range(len(seq.block_hashes), num_full):
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            prefix_hash = seq.block_hashes[-1] if seq.block_hashes else None
            h = chain_hash(tokens, prefix_hash)
            seq.block_hashes.append(h)
            if not self.enable_prefix_caching:
                continue
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.hash, block.token_ids = h, tokens
                self.hash_to_block_id.setdefault(h, block.block_id)

    # ---- allocation ---------------------------------------------------------------------

    def can_allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> bool:
        """Whether seq (holding no blocks) can take cached_blocks plus room for num_new_tokens."""
        num_cached_tokens = len(cached_blocks) * self.block_size
        num_new_blocks = self.blocks_for(num_cached_tokens + num_new_tokens) - len(cached_blocks)
        num_revived = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        return num_new_blocks + num_revived <= self.num_free_blocks

    def allocate(self, seq: Sequence, cached_blocks: list[int], num_new_tokens: int) -> None:
        """Gives a waiting seq its cached prefix blocks and new blocks for num_new_tokens."""
        assert not seq.block_table, f"seq {seq.seq_id} already holds blocks"
        assert self.can_allocate(seq, cached_blocks, num_new_tokens), "allocate() without can_allocate()"
        for block_id in cached_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(block.hash)
        seq.num_computed_tokens = len(cached_blocks) * self.block_size
        self.append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grows seq's block table to hold num_new_tokens more computed tokens."""
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert needed <= self.num_free_blocks, "append() without can_append()"
        for _ in range(needed):
            seq.block_table.append(self._take_free_block())

    def deallocate(self, seq: Sequence) -> None:
        """Releases seq's blocks; the last ones go back first, so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"block {block_id} freed twice"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.forget_kv()

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} is referenced"
        if block.hash is not None:  # evict its cached content
            if self.hash_to_block_id.get(block.hash) == block_id:
                del self.hash_to_block_id[block.hash]
            block.hash, block.token_ids = None, []
        block.ref_count = 1
        return block_id
