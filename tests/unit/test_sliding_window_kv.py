"""Sliding-window KV: the layer groups a model's windows make (core/kv_layout.py), and the
KV manager giving a sliding group's blocks behind its window back to the pool, finding
prefixes and leaving session histories across groups (block size 4, exact block counts)."""
from __future__ import annotations

import pytest

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_layout import KVLayout
from sluice.core.scheduler import SampledToken, Scheduler, StepResult
from sluice.request import Request
from sluice.sampling_params import SamplingParams

BS = 4
WINDOW = 8   # a query sees itself and the 7 keys before it: at most 3 blocks of 4


def gemma3_windows(num_layers: int, window: int = 512) -> tuple[int, ...]:
    return tuple(0 if (i + 1) % 6 == 0 else window for i in range(num_layers))


def test_layouts_of_real_models():
    plain = KVLayout.for_windows(30, ())
    assert plain.num_groups == 1 and plain.group_size == 30 and plain.describe() == "plain"
    mistral = KVLayout.for_windows(4, (4096,) * 4)
    assert mistral.windows == (4096,) and mistral.group_size == 4
    # Gemma 3 270M: 3 global layers (5, 11, 17) and 15 local ones: 6 groups of 3 layers.
    g270 = KVLayout.for_windows(18, gemma3_windows(18))
    assert g270.group_size == 3 and g270.windows == (0, 512, 512, 512, 512, 512)
    assert g270.groups[0].layers == (5, 11, 17) and g270.groups[1].layers == (0, 1, 2)
    assert g270.describe() == "full:1x3 sliding512:5x3"
    places = g270.layer_places(18)
    assert places[5] == (0, 0) and places[17] == (0, 2) and places[4] == (2, 1)
    # Every layer in exactly one (group, tensor) place, no two layers in the same one.
    assert sorted(places) == sorted(set(places)) and len(set(places)) == 18
    # Gemma 3 4B: 5 global, 29 local: groups of 5, the last local group one layer short.
    g4b = KVLayout.for_windows(34, gemma3_windows(34, 1024))
    assert g4b.group_size == 5 and g4b.num_groups == 7 and len(g4b.groups[-1].layers) == 4
    with pytest.raises(ValueError, match="3 layer windows for 4 layers"):
        KVLayout.for_windows(4, (0, 8, 8))


def req(rid: str, tokens, max_tokens: int = 4, **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0, max_tokens=max_tokens), {0}, max_tokens, **kw)


def grow(kv: KVCacheManager, r: Request, chunk: int) -> None:
    """Compute r's tokens `chunk` at a time, as the scheduler would."""
    while r.num_computed_tokens < r.num_tokens:
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        assert kv.allocate(r, n) is not None
        r.num_computed_tokens += n


def test_a_sliding_group_holds_only_its_window():
    kv = KVCacheManager(64, BS, windows=(0, WINDOW))
    r = req("a", range(100, 140))             # 40 tokens: 10 blocks
    grow(kv, r, 4)
    full, sliding = kv.req_blocks["a"]
    assert all(b is not None for b in full) and len(full) == 10
    # The last step's queries (positions 36..39) see keys 29..39: blocks 7, 8, 9.
    held = [i for i, b in enumerate(sliding) if b is not None]
    assert held == [7, 8, 9]
    assert kv.blocks_by_group() == [10, 3] and kv.num_free_blocks == 64 - 13
    null = kv.null_block_id
    assert kv.block_ids("a", 1)[:7] == [null] * 7 and null == 64
    assert kv.group_block_ids("a")[0] == kv.block_ids("a")
    # A decode step past the block: block 7 leaves, block 10 arrives.
    r.output_token_ids.append(5)
    assert kv.allocate(r, 1) is not None
    r.num_computed_tokens += 1
    assert [i for i, b in enumerate(kv.req_blocks["a"][1]) if b is not None] == [8, 9, 10]
    assert kv.blocks_by_group() == [11, 3]
    kv.free(r)
    assert kv.num_free_blocks == 64 and kv.blocks_by_group() == [0, 0] and not kv.req_lo


def test_given_back_blocks_count_as_room():
    """A request whose window slides frees a block as it takes one: with one free block in
    the pool a sliding-only model's decode still fits (a plain cache would need a new one
    every 4 tokens forever)."""
    kv = KVCacheManager(4, BS, windows=(WINDOW,))
    r = req("a", range(100, 112), max_tokens=40)
    grow(kv, r, 12)                            # 3 blocks for its prompt, 1 free
    for t in range(30):
        r.output_token_ids.append(7)
        assert kv.free_blocks_taken(r, 1) <= kv.num_free_blocks
        assert kv.allocate(r, 1) is not None, t
        r.num_computed_tokens += 1
        assert kv.blocks_by_group()[0] <= 4
    kv.free(r)
    assert kv.num_free_blocks == 4


def test_capacity_counts_windows():
    plain = KVCacheManager(10, BS)
    assert plain.capacity_tokens(16, 1000) == 40
    sliding = KVCacheManager(10, BS, windows=(WINDOW,))
    assert sliding.capacity_tokens(16, 1000) == 1000          # a window's blocks whatever the length
    hybrid = KVCacheManager(20, BS, windows=(0, WINDOW))
    # Full group: n blocks; sliding: at most cdiv(7 + 16, 4) + 1 = 7.
    assert hybrid.peak_blocks(52, 16) == 13 + 7 and hybrid.capacity_tokens(16, 1000) == 52


def cached_run(kv: KVCacheManager, r: Request, chunk: int = 4):
    prefix = kv.find_cached_prefix(r)
    assert kv.allocate(r, min(chunk, r.num_tokens - prefix.num_tokens), prefix) is not None
    r.num_computed_tokens += prefix.num_tokens + min(chunk, r.num_tokens - prefix.num_tokens)
    grow(kv, r, chunk)
    return prefix


def test_prefix_hits_need_the_window_before_them():
    kv = KVCacheManager(64, BS, enable_caching=True, windows=(0, WINDOW))
    a = req("a", range(100, 141))              # 41 tokens: 10 full blocks
    cached_run(kv, a)
    kv.free(a)
    # Every full block was named in both groups while a held it (the sliding ones before
    # they went back to the pool): the whole prefix is found.
    b = req("b", list(range(100, 141)) + [7, 7])
    prefix = kv.find_cached_prefix(b)
    assert prefix.num_tokens == 40
    full, sliding = prefix.tables
    assert len(full) == 10 and all(x is not None for x in full)
    # Queries from position 40 on see keys 33..: the sliding group takes blocks 8 and 9 only.
    assert [i for i, x in enumerate(sliding) if x is not None] == [8, 9]
    assert len(prefix.blocks) == 12
    # Drop one sliding block inside that window: the longest prefix whose window is whole
    # ends before it (block 9 gone: prefixes of 10 blocks need it; 9 blocks need 7 and 8).
    kv.pool.uncache(sliding[9])
    p2 = kv.find_cached_prefix(req("c", list(range(100, 141)) + [7]))
    assert p2.num_tokens == 36
    assert [i for i, x in enumerate(p2.tables[1]) if x is not None] == [7, 8]
    # A full-group miss caps it too: without full block 3, at most 3 blocks.
    kv.pool.uncache(full[3])
    assert kv.find_cached_prefix(req("d", list(range(100, 141)) + [7])).num_tokens == 12
    # Taking a prefix: the request's tables hold it, the rest grows from there.
    e = req("e", list(range(100, 141)) + [7, 7, 7])
    cached_run(kv, e)
    assert len(kv.req_blocks["e"][0]) == 11
    kv.free(e)
    assert kv.num_free_blocks == 64


def test_session_history_is_its_full_blocks_and_its_window():
    kv = KVCacheManager(64, BS, windows=(0, WINDOW))
    a = req("a", range(100, 130), session_id="s")   # 30 tokens: 7 full blocks
    grow(kv, a, 8)
    h = kv.history(a)
    assert h.num_full_blocks == 7
    full, sliding = kv.req_blocks["a"]
    # Full: blocks 0..6; sliding: the window before token 28 (keys 21..27: blocks 5, 6).
    assert set(h.blocks) == set(full[:7]) | {sliding[5], sliding[6]}
    nxt = req("a2", list(range(100, 130)) + [1, 2, 3], session_id="s")
    assert kv.resends(nxt, h.num_full_blocks, h.last_hash)
    assert not kv.resends(req("x", list(range(101, 135)), session_id="s"), h.num_full_blocks, h.last_hash)


def test_scheduler_runs_sliding_groups_to_completion_without_leaks():
    """The scheduler over a hybrid layout: chunked prompts, decodes, preemption under a
    small pool; every plan consistent, every block back at the end."""
    kv = KVCacheManager(24, BS, windows=(0, WINDOW, WINDOW))
    config = SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=8)
    sched = Scheduler(config, kv, 200)
    for i, n in enumerate((30, 9, 17, 40)):
        sched.add_request(Request(f"r{i}", [100 + i * 50 + j for j in range(n)],
                                  SamplingParams(temperature=0, max_tokens=12), {0}, 12))
    most_sliding = 0
    while sched.has_unfinished_requests():
        plan = sched.schedule()
        for e in plan.scheduled:
            assert e.group_block_ids is not None and e.group_block_ids[0] == e.block_ids
            # Every slot this step writes sits in a block the request holds in each group.
            for table in e.group_block_ids:
                for p in range(e.start_pos, e.start_pos + len(e.token_ids)):
                    assert table[p // BS] != kv.null_block_id
        used = kv.blocks_by_group()
        most_sliding = max(most_sliding, used[1], used[2])
        assert sum(used) + kv.num_free_blocks == kv.num_blocks
        sched.update(plan, StepResult({e.request_id: SampledToken(5) for e in plan.scheduled if e.needs_logits}))
    assert kv.num_free_blocks == kv.num_blocks and kv.blocks_by_group() == [0, 0, 0]
    # Four requests at a time at most, each sliding group holding at most 4 blocks of each.
    assert most_sliding <= 4 * 4
