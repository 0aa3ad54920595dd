"""BlockPool, FreeBlockQueue and KVCacheManager: exact block ids, no model."""
from __future__ import annotations

import pytest

from sluice.core.block_pool import BlockPool, FreeBlockQueue, KVBlock
from sluice.core.kv_cache_manager import KVAllocation, KVCacheManager, cdiv
from sluice.request import Request
from sluice.sampling_params import SamplingParams


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def make_request(request_id: str, num_computed: int = 0) -> Request:
    req = Request(request_id, [1, 2, 3], SamplingParams(temperature=0, max_tokens=4),
                  eos_token_ids={0}, max_tokens=4)
    req.num_computed_tokens = num_computed
    return req


# -- FreeBlockQueue -----------------------------------------------------------

def test_free_queue_keeps_insertion_order():
    """The queue lists blocks in the order they were given and counts them."""
    q = FreeBlockQueue([KVBlock(i) for i in (3, 1, 2)])
    assert q.ids() == [3, 1, 2]
    assert q.num_free == 3


def test_free_queue_popleft_takes_head_and_append_goes_to_tail():
    """popleft returns the head (oldest); append puts a block at the tail."""
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue(blocks)
    b = q.popleft()
    assert b.block_id == 0 and b.prev is None and b.next is None
    assert q.ids() == [1, 2, 3]
    q.append(b)
    assert q.ids() == [1, 2, 3, 0]
    assert q.num_free == 4


def test_free_queue_remove_from_middle_is_local():
    """remove() unlinks a middle block in O(1) and leaves its neighbours linked."""
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert q.ids() == [0, 1, 3, 4]
    assert q.num_free == 4
    assert blocks[2].prev is None and blocks[2].next is None
    assert blocks[1].next is blocks[3] and blocks[3].prev is blocks[1]
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert q.ids() == [1, 3]
    assert q.head.next is blocks[1] and q.tail.prev is blocks[3]


def test_free_queue_popleft_empty_raises():
    """Popping an empty queue raises IndexError instead of returning a sentinel."""
    q = FreeBlockQueue([KVBlock(0)])
    q.popleft()
    assert q.num_free == 0 and q.ids() == []
    with pytest.raises(IndexError):
        q.popleft()


# -- BlockPool ----------------------------------------------------------------

def test_pool_initial_free_order():
    """A fresh pool has every block free, in order 0..N-1, with ref_cnt 0."""
    pool = BlockPool(6)
    assert pool.free_queue.ids() == [0, 1, 2, 3, 4, 5]
    assert pool.num_free_blocks == 6
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_pool_rejects_empty():
    """A pool needs at least one block."""
    with pytest.raises(ValueError):
        BlockPool(0)


def test_pool_allocate_takes_from_head():
    """allocate() takes blocks from the LRU head and sets ref_cnt to 1."""
    pool = BlockPool(6)
    first = pool.allocate(2)
    assert ids(first) == [0, 1]
    assert all(b.ref_cnt == 1 for b in first)
    assert ids(pool.allocate(3)) == [2, 3, 4]
    assert pool.free_queue.ids() == [5]
    assert pool.num_free_blocks == 1


def test_pool_free_appends_in_given_order():
    """free() appends blocks to the tail in the order given; they are reused in that order."""
    pool = BlockPool(6)
    a = pool.allocate(3)            # 0, 1, 2
    pool.free(list(reversed(a)))    # tail first, as the manager does
    assert pool.free_queue.ids() == [3, 4, 5, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in a)
    assert ids(pool.allocate(4)) == [3, 4, 5, 2]
    assert pool.free_queue.ids() == [1, 0]


def test_pool_allocate_zero_is_noop():
    """allocate(0) returns nothing and takes nothing."""
    pool = BlockPool(3)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 3


def test_pool_allocate_too_many_raises_and_takes_nothing():
    """Asking for more blocks than are free raises ValueError and leaves the pool intact."""
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.free_queue.ids() == [3]


def test_pool_double_free_raises():
    """Freeing a block whose ref_cnt is already 0 raises and does not corrupt the list."""
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])
    assert pool.free_queue.ids() == [1, 2, 0]
    assert pool.num_free_blocks == 3


def test_pool_free_never_allocated_raises():
    """Freeing a block that was never allocated is a double free too."""
    pool = BlockPool(2)
    with pytest.raises(RuntimeError):
        pool.free([pool.blocks[1]])
    assert pool.free_queue.ids() == [0, 1]


def test_pool_usage():
    """usage() is the fraction of blocks in use."""
    pool = BlockPool(4)
    assert pool.usage() == 0.0
    a = pool.allocate(1)
    assert pool.usage() == pytest.approx(0.25)
    b = pool.allocate(3)
    assert pool.usage() == pytest.approx(1.0)
    pool.free(a + b)
    assert pool.usage() == 0.0


# -- KVCacheManager -----------------------------------------------------------

def test_cdiv_and_blocks_needed():
    """blocks_needed rounds the token count up to whole blocks."""
    assert [cdiv(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert [kv.blocks_needed(n) for n in (0, 1, 3, 4, 5, 16, 17)] == [0, 1, 1, 1, 2, 4, 5]


def test_manager_allocate_returns_new_block_ids():
    """allocate() returns a KVAllocation with only the newly given block ids."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("a")
    alloc = kv.allocate(req, 6)
    assert alloc == KVAllocation((), (0, 1))
    assert kv.block_ids("a") == [0, 1]
    req.num_computed_tokens = 6
    assert kv.allocate(req, 2) == KVAllocation((), ())      # 8 tokens still fit 2 blocks
    assert kv.block_ids("a") == [0, 1]
    assert kv.allocate(req, 3) == KVAllocation((), (2,))    # 9 tokens need a 3rd block
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage() == pytest.approx(3 / 8)


def test_manager_requests_get_disjoint_blocks():
    """Two requests get different blocks, handed out from the head of the free list."""
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate(a, 5).new_block_ids == (0, 1)
    assert kv.allocate(b, 4).new_block_ids == (2,)
    assert kv.block_ids("a") == [0, 1]
    assert kv.block_ids("b") == [2]
    assert kv.block_ids("nobody") == []


def test_manager_allocate_none_when_short_and_takes_nothing():
    """When the pool cannot supply every needed block, allocate() returns None and takes none."""
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert kv.allocate(a, 8).new_block_ids == (0, 1)
    assert kv.allocate(b, 8) is None
    assert kv.num_free_blocks == 1
    assert kv.block_ids("b") == []
    assert kv.pool.free_queue.ids() == [2]
    assert kv.allocate(b, 4).new_block_ids == (2,)


def test_manager_free_returns_all_blocks_tail_first():
    """free() returns every block of a request, tail first, so its tail block is reused first."""
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    kv.allocate(a, 12)              # 0, 1, 2
    kv.allocate(b, 4)               # 3
    assert kv.num_free_blocks == 0
    kv.free(a)
    assert kv.num_free_blocks == 3
    assert kv.block_ids("a") == []
    assert kv.pool.free_queue.ids() == [2, 1, 0]
    c = make_request("c")
    assert kv.allocate(c, 4).new_block_ids == (2,)
    kv.free(b)
    kv.free(c)
    kv.free(a)                      # freeing a request with no blocks is a no-op
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.pool.free_queue.ids() == [1, 0, 3, 2]
