"""BlockManager: exact block ids, reference counts and prefix-cache reuse."""

from twinplane.controlplane.block_manager import BlockManager, chain_hash
from twinplane.controlplane.sequence import RequestParams, Sequence

PARAMS = RequestParams(max_tokens=8)


def seq(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id, str(seq_id), tokens, PARAMS)


def compute(bm: BlockManager, s: Sequence, num_tokens: int) -> None:
    """What the scheduler does around a step: room first, then the step's result."""
    bm.append(s, num_tokens)
    s.num_computed_tokens += num_tokens
    bm.cache_full_blocks(s, s.num_computed_tokens)


def test_allocate_gives_lowest_free_blocks_and_counts_refs():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(1, list(range(10)))
    bm.allocate(a, [], 10)
    assert a.block_table == [0, 1, 2]
    assert [bm.blocks[i].ref_count for i in range(4)] == [1, 1, 1, 0]
    assert bm.num_free_blocks == 5


def test_append_adds_a_block_only_when_the_last_one_is_full():
    bm = BlockManager(num_blocks=8, block_size=4)
    a = seq(1, [1, 2, 3])
    bm.allocate(a, [], 3)
    a.num_computed_tokens = 3
    assert bm.can_append(a, 1)
    bm.append(a, 1)
    assert a.block_table == [0]
    a.num_computed_tokens = 4
    bm.append(a, 1)
    assert a.block_table == [0, 1]


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    prompt = list(range(100, 112))  # exactly 3 blocks
    a = seq(1, prompt)
    bm.allocate(a, [], 12)
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a, 12)
    assert a.block_hashes[1] == chain_hash(prompt[4:8], chain_hash(prompt[:4], None))
    b = seq(2, prompt)
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1]  # the third block holds the last token, which must be recomputed
    bm.allocate(b, cached, 12 - 8)
    assert b.block_table == [0, 1, 3]
    assert b.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in range(4)] == [2, 2, 1, 1]


def test_hash_hit_is_verified_against_tokens():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq(1, [1, 2, 3])
    compute(bm, a, 3)
    h = a.block_hashes[0]
    bm.blocks[0].token_ids = [9, 9]  # simulate a colliding hash with other tokens
    assert bm.hash_to_block_id[h] == 0
    assert bm.find_cached_blocks(seq(2, [1, 2, 3])) == []


def test_freed_blocks_stay_cached_until_evicted_tail_first():
    bm = BlockManager(num_blocks=4, block_size=2)
    a = seq(1, [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    assert a.block_table == [0, 1, 2]
    bm.deallocate(a)
    assert a.block_table == [] and bm.num_free_blocks == 4
    # free order: 3 (never used), then a's blocks tail first: 2, 1, 0
    assert list(bm.free_block_ids) == [3, 2, 1, 0]
    b = seq(2, [1, 2, 3, 4, 9])
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1]
    bm.allocate(b, cached, 1)
    assert b.block_table == [0, 1, 3]  # revived 0 and 1, new block 3
    assert b.num_computed_tokens == 4
    c = seq(3, [7, 7])
    bm.allocate(c, [], 2)  # takes 2, a's partial tail block, which had no hash
    assert c.block_table == [2]
    assert bm.num_free_blocks == 0


def test_eviction_removes_the_hash():
    bm = BlockManager(num_blocks=2, block_size=2)
    a = seq(1, [1, 2, 3])
    compute(bm, a, 3)
    bm.deallocate(a)
    b = seq(2, [5, 6, 7, 8, 9])
    bm.allocate(b, [], 4)  # needs both blocks: evicts a's cached block 0
    assert bm.hash_to_block_id == {}
    assert bm.find_cached_blocks(seq(3, [1, 2, 3])) == []


def test_can_allocate_counts_revived_cached_blocks():
    bm = BlockManager(num_blocks=3, block_size=2)
    a = seq(1, [1, 2, 3, 4, 5])
    compute(bm, a, 5)
    bm.deallocate(a)
    b = seq(2, [1, 2, 3, 4, 6, 7, 8])
    cached = bm.find_cached_blocks(b)
    assert cached == [0, 1]
    assert bm.can_allocate(b, cached, 2)  # 2 revived + 1 new = 3 blocks
    assert not bm.can_allocate(b, cached, 3)  # would need 4


def test_without_prefix_caching_nothing_is_reused():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = seq(1, [1, 2, 3])
    compute(bm, a, 3)
    assert bm.find_cached_blocks(seq(2, [1, 2, 3])) == []
