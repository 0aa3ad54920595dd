"""Prefix caching in the KV manager and block pool, with exact block ids (block size 4)."""
from __future__ import annotations

from sluice.core.kv_cache_manager import KVAllocation, KVCacheManager
from sluice.request import Request
from sluice.sampling_params import SamplingParams


def req(rid, tokens, salt=None, share=None):
    return Request(rid, tokens, SamplingParams(temperature=0, max_tokens=4), {0}, 4,
                   cache_salt=salt, share_key=share)


def run(kv, r, prefix=None):
    """Admit r as the scheduler does, compute its whole prompt, and return the allocation."""
    prefix = kv.find_cached_prefix(r) if prefix is None else prefix
    alloc = kv.allocate(r, r.num_tokens - prefix.num_tokens, prefix)
    r.num_computed_tokens = r.num_tokens
    return alloc


PROMPT = list(range(10, 20))  # 10 tokens: two full blocks and two tokens


def test_full_prefix_hit_reuses_exact_blocks():
    kv = KVCacheManager(8, 4, enable_caching=True)
    a = req("a", PROMPT)
    assert run(kv, a) == KVAllocation((), (0, 1, 2))
    kv.free(a)
    # Freed tail first: free list is 3..7, then 2, 1, 0. Block 2 was partial: not cached.
    assert kv.pool.free_queue.ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert kv.num_cached_blocks == 2
    b = req("b", PROMPT)
    prefix = kv.find_cached_prefix(b)
    assert [blk.block_id for blk in prefix.blocks] == [0, 1] and prefix.num_tokens == 8
    assert run(kv, b, prefix) == KVAllocation((0, 1), (3,))
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 2]
    assert (kv.query_tokens, kv.hit_tokens) == (20, 8)


def test_partial_prefix_hit_and_last_token_always_computed():
    kv = KVCacheManager(8, 4, enable_caching=True)
    a = req("a", PROMPT)
    run(kv, a)
    kv.free(a)
    b = req("b", PROMPT[:4] + [99] * 6)           # shares only the first block
    assert [x.block_id for x in kv.find_cached_prefix(b).blocks] == [0]
    c = req("c", PROMPT[:8])                      # exactly two full blocks cached...
    p = kv.find_cached_prefix(c)
    assert p.num_tokens == 4                      # ...but the last token must be computed


def test_shared_blocks_are_ref_counted():
    kv = KVCacheManager(8, 4, enable_caching=True)
    a, b = req("a", PROMPT), req("b", PROMPT)
    run(kv, a)
    assert run(kv, b) == KVAllocation((0, 1), (3,))
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert kv.pool.free_queue.ids() == [4, 5, 6, 7, 2]
    kv.free(b)
    assert kv.num_free_blocks == 8


def test_eviction_is_least_recently_freed_first():
    kv = KVCacheManager(6, 4, enable_caching=True)
    a, b = req("a", list(range(9))), req("b", list(range(100, 109)))
    run(kv, a)                                    # blocks 0, 1, 2
    run(kv, b)                                    # blocks 3, 4, 5
    kv.free(a)
    kv.free(b)
    assert kv.pool.free_queue.ids() == [2, 1, 0, 5, 4, 3]
    c = req("c", list(range(200, 209)))           # needs 3 blocks: evicts 2 (partial), 1, 0
    assert run(kv, c) == KVAllocation((), (2, 1, 0))
    assert kv.find_cached_prefix(req("a2", list(range(9)))).num_tokens == 0
    assert kv.find_cached_prefix(req("b2", list(range(100, 109)))).num_tokens == 8


def test_salts_separate_tenants():
    kv = KVCacheManager(8, 4, enable_caching=True)
    a = req("a", PROMPT, salt="tenant-1")
    run(kv, a)
    kv.free(a)
    assert kv.find_cached_prefix(req("b", PROMPT, salt="tenant-2")).num_tokens == 0
    assert kv.find_cached_prefix(req("c", PROMPT)).num_tokens == 0
    assert kv.find_cached_prefix(req("d", PROMPT, salt="tenant-1")).num_tokens == 8


def test_reset_forgets_everything():
    kv = KVCacheManager(8, 4, enable_caching=True)
    a = req("a", PROMPT)
    run(kv, a)
    kv.free(a)
    assert kv.reset_prefix_cache() == 2
    assert kv.num_cached_blocks == 0
    assert kv.find_cached_prefix(req("b", PROMPT)).num_tokens == 0


def test_uncomputed_blocks_lose_their_hash_when_freed():
    """A request preempted before its chunk was computed must not leave a hash behind."""
    kv = KVCacheManager(8, 4, enable_caching=True)
    a = req("a", PROMPT)
    kv.allocate(a, 10)                            # names blocks 0 and 1 for this step...
    assert kv.num_cached_blocks == 2
    kv.free(a)                                    # ...but nothing was computed
    assert kv.num_cached_blocks == 0


def test_samples_share_prompt_blocks_with_caching_off():
    kv = KVCacheManager(8, 4, enable_caching=False)
    s0, s1 = req("p#0", PROMPT, share="p"), req("p#1", PROMPT, share="p")
    assert run(kv, s0) == KVAllocation((), (0, 1, 2))
    assert run(kv, s1) == KVAllocation((0, 1), (3,))
    other = req("q", PROMPT)                      # another request: no sharing, caching is off
    assert kv.find_cached_prefix(other).num_tokens == 0
    kv.free(s0)
    kv.free(s1)
    assert kv.num_cached_blocks == 0 and kv.num_free_blocks == 8
