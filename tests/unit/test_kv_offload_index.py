"""OffloadIndex (core/kv_offload.py) and its place under the KV cache manager: which copies
are decided, in which order, and what a prefix lookup finds in the tiers."""
from __future__ import annotations

import pytest

from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_offload import OffloadIndex
from sluice.request import Request
from sluice.sampling_params import SamplingParams


def key(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_saves_spill_the_coldest_host_block_to_disk_and_drop_past_the_disk():
    ix = OffloadIndex(host_blocks=2, disk_blocks=1)
    for i in range(4):
        ix.save(block_id=10 + i, key=key(i))
    t = ix.take_transfers()
    # Block 0 and 1 fill the host; 2 pushes 0 to disk; 3 pushes 1 to disk, whose 0 is dropped.
    assert t == [("save", 10, 0, key(0)), ("save", 11, 1, key(1)),
                 ("spill", 0, 0, key(0)), ("save", 12, 0, key(2)),
                 ("spill", 1, 0, key(1)), ("save", 13, 1, key(3))]
    assert [ix.where(key(i)) for i in range(4)] == [None, "disk", "host", "host"]
    assert ix.disk.stats.dropped == 1 and ix.host.stats.saved == 4


def test_a_saved_key_is_not_copied_twice_and_a_hit_refreshes_it():
    ix = OffloadIndex(host_blocks=2)
    ix.save(1, key(1))
    ix.save(2, key(2))
    ix.save(3, key(1))  # the same content again: no copy
    assert len(ix.take_transfers()) == 2
    ix.load(key(1), 7)
    assert ix.take_transfers() == [("load", 0, 7, key(1))]
    ix.save(4, key(3))  # the LRU one is 2 (1 was just used)
    assert ix.where(key(2)) is None and ix.where(key(1)) == "host"


def test_locked_keys_are_never_evicted_by_the_allocation_reloading_them():
    ix = OffloadIndex(host_blocks=1)
    ix.save(1, key(1))
    ix.locked.add(key(1))
    ix.save(2, key(2))  # nowhere to go: lost rather than overwrite the block being reloaded
    assert ix.where(key(1)) == "host" and ix.where(key(2)) is None


def test_a_reload_costlier_than_recomputing_is_not_taken():
    ix = OffloadIndex(host_blocks=1, block_size=16)
    ix.save(1, key(1))
    assert ix.where(key(1)) == "host"  # nothing measured yet: reload
    ix.observe_prefill(prompt_tokens=256, seconds=0.256)  # 1 ms a token: 16 ms a block
    ix.observe_loads("host", seconds=0.001, blocks=1)
    assert ix.where(key(1)) == "host"
    for _ in range(40):
        ix.observe_loads("host", seconds=1.0, blocks=1)
    assert ix.where(key(1)) is None
    ix.use_costs = False  # (tests that count reloads): every block a tier holds is taken
    assert ix.where(key(1)) == "host"


def test_failed_reloads_and_a_dead_disk_forget_their_blocks():
    ix = OffloadIndex(host_blocks=1, disk_blocks=2)
    ix.save(1, key(1))
    ix.save(2, key(2))  # key 1 to disk
    ix.failed("load_disk", key(1))
    assert ix.where(key(1)) is None and ix.disk.stats.failed == 1
    ix.save(3, key(3))  # key 2 to disk
    ix.disable_disk()
    assert ix.where(key(2)) is None and ix.disk is None
    ix.save(4, key(4))  # key 3 dropped: no disk any more
    assert ix.take_transfers()[-1] == ("save", 4, 0, key(4))


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), eos_token_ids=set(), max_tokens=4)


def test_a_prefix_found_in_the_tier_takes_fresh_blocks_named_and_loaded():
    ix = OffloadIndex(host_blocks=8)
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_caching=True, offload=ix)
    a = req("a", list(range(1, 14)))  # 3 full blocks + 1 token
    assert kv.allocate(a, 13) is not None
    a.num_computed_tokens = 13  # (as update() counts them once the step ran)
    kv.free(a)
    b = req("b", list(range(100, 116)))  # takes all 4 blocks: a's 3 named ones are evicted
    assert kv.allocate(b, 16) is not None
    saves = ix.take_transfers()
    assert [t[0] for t in saves] == ["save"] * 3 and ix.num_blocks("host") == 3
    kv.free(b)
    a2 = req("a2", list(range(1, 14)))
    prefix = kv.find_cached_prefix(a2)
    assert prefix.num_tokens == 12 and len(prefix.loads) == 3 and not prefix.blocks
    assert kv.free_blocks_taken(a2, 1, prefix) == 4
    assert kv.allocate(a2, 1, prefix) is not None
    t = ix.take_transfers()
    loads = [x for x in t if x[0] == "load"]
    assert len(loads) == 3
    # Each load comes after the save of whatever its destination block held before.
    for i, (kind, _, dst, _) in enumerate(t):
        if kind == "load":
            assert all(not (k == "save" and src == dst) for k, src, _, _ in t[i + 1:])
    table = kv.block_ids("a2")
    assert [x[2] for x in loads] == table[:3]
    assert all(kv.pool.blocks[b].block_hash is not None for b in table[:3])
    kv.free(a2)
    assert kv.num_free_blocks == 4


def test_reset_forgets_the_tiers():
    ix = OffloadIndex(host_blocks=2)
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_caching=True, offload=ix)
    a = req("a", list(range(1, 10)))
    kv.allocate(a, 9)
    a.num_computed_tokens = 9
    kv.free(a)
    assert kv.allocate(req("b", list(range(50, 62))), 12) is not None
    assert ix.num_blocks("host") == 2
    kv.reset_prefix_cache()
    assert ix.num_blocks("host") == 0 and kv.take_transfers() == []


@pytest.mark.parametrize("n", [0, -1])
def test_a_host_tier_needs_a_block(n):
    with pytest.raises(ValueError):
        OffloadIndex(host_blocks=n)


def test_a_prefix_whose_reloads_outgrow_the_free_blocks_is_shortened_and_admitted():
    """Reloads take their blocks at admission, all at once: a history bigger than the free
    pool (the rest held by others) is reloaded as far as it fits and the rest computed,
    rather than waiting for room that only its own progress would make."""
    from sluice.config import SchedulerConfig
    from sluice.core.scheduler import Scheduler
    ix = OffloadIndex(host_blocks=16)
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=True, offload=ix)
    a = req("a", list(range(1, 30)))  # 7 full blocks + 1 token
    assert kv.allocate(a, 29) is not None
    a.num_computed_tokens = 29
    kv.free(a)
    other = req("other", list(range(100, 132)))  # all 8 blocks: a's 7 go to the tier
    assert kv.allocate(other, 32) is not None
    kv.free(other)
    holder = req("holder", list(range(200, 212)))  # 3 blocks held: 5 free
    assert kv.allocate(holder, 12) is not None
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8), kv, 4096)
    again = req("again", list(range(1, 30)))
    sched.add_request(again)
    full = kv.find_cached_prefix(again)
    assert len(full.loads) == 7 and kv.free_blocks_taken(again, 1, full) > kv.num_free_blocks
    plan = sched.schedule()
    assert [e.request_id for e in plan.scheduled] == ["again"]
    entry = plan.scheduled[0]
    assert 0 < entry.start_pos < 28 and again.num_cached_tokens == entry.start_pos
    assert sum(t[0] == "load" for t in plan.kv_transfers) == entry.start_pos // 4
