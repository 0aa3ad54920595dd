"""Scheduler driven by a fake runner (no model): exact plans, block ids, preemption, stops."""
from __future__ import annotations

import random
from typing import Callable

import pytest

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.scheduler import (SampledToken, ScheduledRequest, Scheduler, StepPlan,
                                   StepResult, StepUpdate)
from sluice.request import Request, RequestStatus
from sluice.sampling_params import SamplingParams

EOS = 0
TOK = 7          # the token every fake step samples unless told otherwise (not the EOS)


# -- helpers ------------------------------------------------------------------

def make_scheduler(num_blocks: int, block_size: int = 4, max_num_batched_tokens: int = 64,
                   max_num_seqs: int = 256, max_model_len: int | None = None
                   ) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks, block_size)
    config = SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs)
    return Scheduler(config, kv, max_model_len or num_blocks * block_size), kv


def make_request(request_id: str, prompt_len: int, max_tokens: int, **params) -> Request:
    prompt = [100 + i for i in range(prompt_len)]   # never EOS nor TOK
    return Request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **params),
                   eos_token_ids={EOS}, max_tokens=max_tokens)


def check_plan(sched: Scheduler, plan: StepPlan) -> None:
    """Invariants every plan must satisfy, checked before the fake runner 'executes' it."""
    kv = sched.kv
    lens = [len(e.token_ids) for e in plan.scheduled]
    assert plan.num_batched_tokens == sum(lens)
    assert plan.num_batched_tokens <= sched.config.max_num_batched_tokens
    assert all(n > 0 for n in lens)
    rids = [e.request_id for e in plan.scheduled]
    assert len(rids) == len(set(rids))
    assert not set(rids) & set(plan.preempted)
    assert len(sched.running) <= sched.config.max_num_seqs
    seen_blocks: set[int] = set()
    for e in plan.scheduled:
        req = sched.requests[e.request_id]
        assert req.status is RequestStatus.RUNNING and req in sched.running
        assert e.start_pos == req.num_computed_tokens
        assert e.token_ids == (req.prompt_token_ids + req.output_token_ids)[
            e.start_pos:e.start_pos + len(e.token_ids)]
        assert e.needs_logits == (e.start_pos + len(e.token_ids) == req.num_tokens)
        # Exactly the blocks needed for everything computed after this step, no more.
        assert e.block_ids == kv.block_ids(e.request_id)
        assert len(e.block_ids) == kv.blocks_needed(e.start_pos + len(e.token_ids))
        assert not seen_blocks & set(e.block_ids)
        seen_blocks |= set(e.block_ids)
    for rid in plan.preempted:
        assert kv.block_ids(rid) == []
    held = sum(len(table) for tables in kv.req_blocks.values() for table in tables)
    assert held + kv.num_free_blocks == kv.num_blocks


def always(token: int) -> Callable[[ScheduledRequest], int]:
    return lambda entry: token


def step(sched: Scheduler, sample: Callable[[ScheduledRequest], int] = always(TOK)
         ) -> tuple[StepPlan, StepUpdate]:
    """One engine step with a fake runner that samples `sample(entry)` for each logits row."""
    plan = sched.schedule()
    check_plan(sched, plan)
    result = StepResult({e.request_id: SampledToken(sample(e)) for e in plan.scheduled if e.needs_logits})
    return plan, sched.update(plan, result)


def run_to_completion(sched: Scheduler, sample: Callable[[ScheduledRequest], int] = always(TOK),
                      max_steps: int = 1000) -> list[StepPlan]:
    plans = []
    while sched.has_unfinished_requests():
        assert len(plans) < max_steps, "scheduler made no progress (deadlock or livelock)"
        plan, _ = step(sched, sample)
        plans.append(plan)
    return plans


def entry(plan: StepPlan, request_id: str) -> ScheduledRequest:
    (e,) = [e for e in plan.scheduled if e.request_id == request_id]
    return e


def summary(plan: StepPlan) -> list[tuple[str, int, int, list[int], bool]]:
    """(request_id, start_pos, num_tokens, block_ids, needs_logits) per entry, in plan order."""
    return [(e.request_id, e.start_pos, len(e.token_ids), e.block_ids, e.needs_logits)
            for e in plan.scheduled]


# -- a single request ---------------------------------------------------------

def test_single_request_prefill_then_decode_with_exact_blocks():
    """One prompt prefills in one step, then decodes one token per step; blocks grow at boundaries."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    req = make_request("a", prompt_len=6, max_tokens=5)
    sched.add_request(req)
    assert sched.num_waiting == 1 and req.status is RequestStatus.WAITING

    plan, update = step(sched)
    assert summary(plan) == [("a", 0, 6, [0, 1], True)]
    assert entry(plan, "a").token_ids == req.prompt_token_ids
    assert update.with_new_token == [req] and update.finished == []
    assert req.status is RequestStatus.RUNNING and req.num_computed_tokens == 6
    assert req.output_token_ids == [TOK]

    expected = [  # start_pos, block_ids: the 3rd block arrives when token 8 is written
        (6, [0, 1]),
        (7, [0, 1]),
        (8, [0, 1, 2]),
        (9, [0, 1, 2]),
    ]
    for start, blocks in expected:
        plan, update = step(sched)
        assert summary(plan) == [("a", start, 1, blocks, True)]
        assert entry(plan, "a").token_ids == [TOK]
        assert plan.num_batched_tokens == 1

    assert update.finished == [req]
    assert req.output_token_ids == [TOK] * 5
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert req.status.finish_reason == "length"
    assert not sched.has_unfinished_requests()
    assert "a" not in sched.requests
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.pool.free_queue.ids() == [3, 4, 5, 6, 7, 2, 1, 0]
    assert sched.schedule().is_empty


def test_finished_requests_tail_block_is_reused_first():
    """When a request finishes, its blocks return tail first, so the next request gets them reversed."""
    sched, kv = make_scheduler(num_blocks=3, block_size=4)
    sched.add_request(make_request("a", prompt_len=9, max_tokens=1))
    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 9, [0, 1, 2], True)]
    assert kv.num_free_blocks == kv.num_blocks
    sched.add_request(make_request("b", prompt_len=9, max_tokens=1))
    plan, _ = step(sched)
    assert summary(plan) == [("b", 0, 9, [2, 1, 0], True)]
    assert kv.num_free_blocks == kv.num_blocks


def test_max_model_len_finishes_with_length():
    """A request stops with 'length' when prompt + outputs reach max_model_len."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4, max_model_len=10)
    req = make_request("a", prompt_len=7, max_tokens=20)
    sched.add_request(req)
    plans = run_to_completion(sched)
    assert len(plans) == 3
    assert req.num_tokens == 10 and req.num_output_tokens == 3
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == kv.num_blocks


def test_duplicate_request_id_rejected():
    """A request id already in use cannot be added again."""
    sched, _ = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 3, 2))
    with pytest.raises(ValueError):
        sched.add_request(make_request("a", 3, 2))
    assert sched.num_waiting == 1
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_blocks


# -- batching and the token budget --------------------------------------------

def test_decode_and_prefill_chunk_share_a_step():
    """A step carries A's decode plus B's prefill chunk, filling the token budget exactly."""
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    a = make_request("a", prompt_len=5, max_tokens=4)
    b = make_request("b", prompt_len=30, max_tokens=2)
    sched.add_request(a)
    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 5, [0, 1], True)]

    sched.add_request(b)
    plan, update = step(sched)
    assert summary(plan) == [("a", 5, 1, [0, 1], True),
                             ("b", 0, 15, [2, 3, 4, 5], False)]
    assert plan.num_batched_tokens == 16
    assert update.with_new_token == [a]
    assert b.num_computed_tokens == 15 and b.output_token_ids == []

    plan, update = step(sched)
    assert summary(plan) == [("a", 6, 1, [0, 1], True),
                             ("b", 15, 15, [2, 3, 4, 5, 6, 7, 8, 9], True)]
    assert plan.num_batched_tokens == 16
    assert update.with_new_token == [a, b]

    plan, update = step(sched)   # a's 4th token finishes it; b decodes its 2nd
    assert summary(plan) == [("a", 7, 1, [0, 1], True), ("b", 30, 1, [2, 3, 4, 5, 6, 7, 8, 9], True)]
    assert update.finished == [a, b]
    assert kv.num_free_blocks == kv.num_blocks


def test_chunked_prefill_40_tokens_with_budget_16():
    """A 40-token prompt under a 16-token budget prefills in chunks of 16, 16, 8; logits only at the end."""
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=16)
    req = make_request("a", prompt_len=40, max_tokens=2)
    sched.add_request(req)

    chunks = []
    for _ in range(3):
        plan, update = step(sched)
        (e,) = plan.scheduled
        chunks.append((e.start_pos, len(e.token_ids), e.needs_logits, e.block_ids))
        assert e.token_ids == req.prompt_token_ids[e.start_pos:e.start_pos + len(e.token_ids)]
        assert e.banned_token_ids == []
        assert req.num_computed_tokens == e.start_pos + len(e.token_ids)
        assert update.with_new_token == ([req] if e.needs_logits else [])
    assert chunks == [
        (0, 16, False, [0, 1, 2, 3]),
        (16, 16, False, [0, 1, 2, 3, 4, 5, 6, 7]),
        (32, 8, True, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
    ]
    assert req.output_token_ids == [TOK]

    plan, update = step(sched)
    assert summary(plan) == [("a", 40, 1, list(range(11)), True)]
    assert update.finished == [req]
    assert kv.num_free_blocks == kv.num_blocks


def test_budget_caps_admissions_and_decodes():
    """A 3-token budget admits three 1-token prompts; the 4th waits, and decodes past the budget wait."""
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=3)
    reqs = [make_request(f"r{i}", prompt_len=1, max_tokens=3) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    plan, _ = step(sched)
    assert [e.request_id for e in plan.scheduled] == ["r0", "r1", "r2"]
    plan, _ = step(sched)   # decodes of r0..r2 fill the budget; r3 stays waiting
    assert [(e.request_id, e.start_pos) for e in plan.scheduled] == [("r0", 1), ("r1", 1), ("r2", 1)]
    assert sched.num_waiting == 1 and sched.num_running == 3
    # Shrink the budget below the number of running decodes: the earliest admitted go first
    # and the others are skipped this step (no zero-token entries).
    sched.config.max_num_batched_tokens = 2
    plan, _ = step(sched)
    assert [(e.request_id, e.start_pos) for e in plan.scheduled] == [("r0", 2), ("r1", 2)]
    assert reqs[2].num_computed_tokens == 2 and reqs[2].num_output_tokens == 2
    sched.config.max_num_batched_tokens = 3
    run_to_completion(sched)
    assert all(r.num_output_tokens == 3 for r in reqs)
    assert kv.num_free_blocks == kv.num_blocks


def test_decodes_scheduled_before_prefill_chunks():
    """Running decodes are planned before a running request's prefill chunk, whatever their order."""
    sched, kv = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    d = make_request("d", prompt_len=2, max_tokens=10)
    p = make_request("p", prompt_len=40, max_tokens=1)
    sched.add_request(d)
    sched.add_request(p)
    plan, _ = step(sched)
    assert summary(plan) == [("d", 0, 2, [0], True), ("p", 0, 6, [1, 2], False)]
    plan, _ = step(sched)
    assert summary(plan) == [("d", 2, 1, [0], True), ("p", 6, 7, [1, 2, 3, 4], False)]
    # Admission order alone would also put d first; list p ahead of d to prove the ordering
    # is by kind (decode first), not by position in the running list.
    sched.running.reverse()
    assert sched.running == [p, d]
    plan, _ = step(sched)
    assert summary(plan) == [("d", 3, 1, [0], True), ("p", 13, 7, [1, 2, 3, 4, 5], False)]
    assert plan.num_batched_tokens == 8
    run_to_completion(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_max_num_seqs_caps_running_and_admits_when_one_finishes():
    """Only max_num_seqs requests run; the extra waits and is admitted the step after one finishes."""
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_seqs=2)
    a = make_request("a", prompt_len=4, max_tokens=2)
    b = make_request("b", prompt_len=4, max_tokens=5)
    c = make_request("c", prompt_len=4, max_tokens=2)
    for r in (a, b, c):
        sched.add_request(r)

    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 4, [0], True), ("b", 0, 4, [1], True)]
    assert sched.running == [a, b] and list(sched.waiting) == [c]
    assert c.status is RequestStatus.WAITING

    plan, update = step(sched)    # a finishes; c must not sneak into this step
    assert summary(plan) == [("a", 4, 1, [0, 2], True), ("b", 4, 1, [1, 3], True)]
    assert update.finished == [a]
    assert list(sched.waiting) == [c]
    assert kv.pool.free_queue.ids()[-2:] == [2, 0]

    plan, _ = step(sched)
    assert summary(plan) == [("b", 5, 1, [1, 3], True), ("c", 0, 4, [4], True)]
    assert sched.running == [b, c] and not sched.waiting

    run_to_completion(sched)
    assert [r.num_output_tokens for r in (a, b, c)] == [2, 5, 2]
    assert kv.num_free_blocks == kv.num_blocks


# -- preemption ---------------------------------------------------------------

def test_preemption_frees_the_most_recent_request_and_recomputes_it():
    """With the pool dry, the last-admitted request is preempted, requeued first and later recomputed."""
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    a = make_request("a", prompt_len=4, max_tokens=8)
    b = make_request("b", prompt_len=4, max_tokens=8)
    c = make_request("c", prompt_len=4, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)

    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 4, [0], True), ("b", 0, 4, [1], True)]
    plan, _ = step(sched)
    assert summary(plan) == [("a", 4, 1, [0, 2], True), ("b", 4, 1, [1, 3], True)]
    assert kv.num_free_blocks == 0
    for _ in range(3):
        plan, _ = step(sched)
        assert plan.preempted == []
    sched.add_request(c)          # waits behind the preempted b later on
    assert a.num_tokens == 9 and b.num_tokens == 9 and b.num_output_tokens == 5

    # a needs a 3rd block for token 9: b (admitted last) is preempted and its tail block goes to a.
    plan, _ = step(sched)
    assert plan.preempted == ["b"]
    assert summary(plan) == [("a", 8, 1, [0, 2, 3], True)]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1 and sched.num_preemptions == 1
    assert b.output_token_ids == [TOK] * 5             # outputs are kept for recompute
    assert kv.block_ids("b") == []
    assert sched.running == [a]
    assert list(sched.waiting) == [b, c]
    assert kv.pool.free_queue.ids() == [1]

    plan, _ = step(sched)          # b needs 3 blocks, 1 is free: it waits, and so does c (FCFS)
    assert summary(plan) == [("a", 9, 1, [0, 2, 3], True)]
    assert list(sched.waiting) == [b, c]

    plan, update = step(sched)
    assert summary(plan) == [("a", 10, 1, [0, 2, 3], True)]
    assert update.finished == [a] and a.num_output_tokens == 8
    assert kv.pool.free_queue.ids() == [1, 3, 2, 0]

    # b comes back and recomputes prompt + its 5 outputs in one chunk, then samples its 6th.
    plan, update = step(sched)
    assert plan.preempted == []
    assert summary(plan) == [("b", 0, 9, [1, 3, 2], True), ("c", 0, 4, [0], True)]
    assert entry(plan, "b").token_ids == b.prompt_token_ids + [TOK] * 5
    assert b.status is RequestStatus.RUNNING and b.num_output_tokens == 6
    assert update.finished == [c]

    run_to_completion(sched)
    assert b.num_output_tokens == 8 and b.status is RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == kv.num_blocks


def test_big_request_preempts_small_one_admitted_after_it():
    """A request needing the whole cache preempts the smaller, later one; both finish, no deadlock."""
    sched, kv = make_scheduler(num_blocks=4, block_size=4)
    big = make_request("big", prompt_len=10, max_tokens=6)      # 15 tokens of KV: all 4 blocks
    small = make_request("small", prompt_len=2, max_tokens=4)
    sched.add_request(big)
    sched.add_request(small)

    plan, _ = step(sched)
    assert summary(plan) == [("big", 0, 10, [0, 1, 2], True), ("small", 0, 2, [3], True)]
    step(sched)
    step(sched)
    plan, _ = step(sched)
    assert plan.preempted == ["small"]
    assert summary(plan) == [("big", 12, 1, [0, 1, 2, 3], True)]
    assert small.num_computed_tokens == 0 and small.num_output_tokens == 3
    assert list(sched.waiting) == [small]

    plans = run_to_completion(sched)
    recompute = [p for p in plans if any(e.request_id == "small" for e in p.scheduled)][0]
    assert summary(recompute) == [("small", 0, 5, [3, 2], True)]
    assert big.num_output_tokens == 6 and small.num_output_tokens == 4
    assert sched.num_preemptions == 1
    assert kv.num_free_blocks == kv.num_blocks


def test_big_request_admitted_last_preempts_itself():
    """When the request that needs a block is the last admitted, it preempts itself and resumes later."""
    sched, kv = make_scheduler(num_blocks=4, block_size=4)
    small = make_request("small", prompt_len=2, max_tokens=8)
    big = make_request("big", prompt_len=10, max_tokens=6)
    sched.add_request(small)
    sched.add_request(big)

    plan, _ = step(sched)
    assert summary(plan) == [("small", 0, 2, [0], True), ("big", 0, 10, [1, 2, 3], True)]
    step(sched)
    step(sched)
    # small needs a 2nd block: the victim is big (admitted last), whose tail block 3 goes to small.
    plan, _ = step(sched)
    assert plan.preempted == ["big"]
    assert summary(plan) == [("small", 4, 1, [0, 3], True)]
    assert big.status is RequestStatus.PREEMPTED and big.num_computed_tokens == 0

    plans = run_to_completion(sched)
    back = [p for p in plans if any(e.request_id == "big" for e in p.scheduled)][0]
    assert summary(back) == [("big", 0, 13, [1, 2, 3, 0], True)]
    assert entry(back, "big").token_ids == big.prompt_token_ids + [TOK] * 3
    assert small.num_output_tokens == 8 and big.num_output_tokens == 6
    assert kv.num_free_blocks == kv.num_blocks


def test_prefill_chunk_that_cannot_grow_preempts_itself():
    """A running prefill chunk that finds no block, as the newest request, preempts itself."""
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=6)
    a = make_request("a", prompt_len=3, max_tokens=10)
    b = make_request("b", prompt_len=12, max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 3, [0], True), ("b", 0, 3, [1], False)]
    plan, _ = step(sched)
    assert summary(plan) == [("a", 3, 1, [0], True), ("b", 3, 5, [1, 2], False)]
    # a's decode takes the last free block (3); b's last chunk needs a 3rd block, none is left,
    # and b is the newest request, so b preempts itself and is dropped from this step's plan.
    plan, _ = step(sched)
    assert plan.preempted == ["b"]
    assert summary(plan) == [("a", 4, 1, [0, 3], True)]
    assert plan.num_batched_tokens == 1
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert kv.pool.free_queue.ids() == [2, 1]
    run_to_completion(sched)
    assert a.num_output_tokens == 10 and b.num_output_tokens == 1
    assert kv.num_free_blocks == kv.num_blocks


def test_victim_already_planned_this_step_is_taken_back():
    """If the victim was already planned this step, its entry is dropped and its tokens refunded."""
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    d = make_request("d", prompt_len=2, max_tokens=3)
    p = make_request("p", prompt_len=14, max_tokens=1)
    sched.add_request(d)
    sched.add_request(p)
    # p's whole prompt (4 blocks) does not fit beside d: admission would leave it waiting.
    # Lift that reserve for one step, to reach the state where p's later chunk is short.
    kv.peak_blocks = lambda num_tokens, chunk: 0
    plan, _ = step(sched)
    del kv.peak_blocks
    assert summary(plan) == [("d", 0, 2, [0], True), ("p", 0, 6, [1, 2], False)]
    # Make d the most recent running request (unreachable through admission alone, where a
    # partial prefill is always last): d's decode is planned first, then p's chunk finds one
    # free block of the two it needs, so d is preempted and its planned decode taken back.
    sched.running.reverse()
    plan, _ = step(sched)
    assert plan.preempted == ["d"]
    assert summary(plan) == [("p", 6, 7, [1, 2, 3, 0], False)]
    assert plan.num_batched_tokens == 7
    assert d.status is RequestStatus.PREEMPTED and d.num_computed_tokens == 0
    assert d.output_token_ids == [TOK]
    run_to_completion(sched)
    assert d.num_output_tokens == 3 and p.num_output_tokens == 1
    assert kv.num_free_blocks == kv.num_blocks


def test_a_long_prompt_waits_until_its_whole_prompt_fits():
    """Admission leaves room for the prompts it admits to finish: p (14 tokens, 4 blocks,
    in chunks of 6) is not admitted beside d, whose block would leave p one short, and
    waits for d to finish instead of being preempted and recomputed halfway."""
    sched, kv = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    d = make_request("d", prompt_len=2, max_tokens=3)
    p = make_request("p", prompt_len=14, max_tokens=1)
    sched.add_request(d)
    sched.add_request(p)
    plan, _ = step(sched)
    assert summary(plan) == [("d", 0, 2, [0], True)]
    run_to_completion(sched)
    assert sched.num_preemptions == 0 and p.num_output_tokens == 1
    assert kv.num_free_blocks == kv.num_blocks


def test_random_workloads_finish_with_every_block_free():
    """Many mixed requests on a tiny pool with chunked prefill all finish, within budget, leak-free."""
    total_preemptions = 0
    for seed in range(20):
        rng = random.Random(seed)
        block_size = rng.choice([1, 2, 4, 8])
        num_blocks = rng.randint(4, 12)
        capacity = num_blocks * block_size
        sched, kv = make_scheduler(num_blocks=num_blocks, block_size=block_size,
                                   max_num_batched_tokens=rng.randint(1, 24),
                                   max_num_seqs=rng.randint(1, 6), max_model_len=capacity)
        reqs = []
        for i in range(rng.randint(1, 10)):
            prompt_len = rng.randint(1, capacity - 1)
            max_tokens = rng.randint(1, capacity - prompt_len)   # as the engine's _check_fits allows
            reqs.append(make_request(f"s{seed}-{i}", prompt_len, max_tokens))
        pending = list(reqs)
        steps = 0
        while pending or sched.has_unfinished_requests():
            if pending and rng.random() < 0.5:
                sched.add_request(pending.pop(0))
            step(sched)
            steps += 1
            assert steps < 5000, f"seed {seed}: no progress"
        assert all(r.status is RequestStatus.FINISHED_LENGTH for r in reqs), seed
        assert all(r.num_output_tokens == r.max_tokens for r in reqs), seed
        assert kv.num_free_blocks == kv.num_blocks, seed
        assert kv.req_blocks == {}, seed
        assert sched.running == [] and not sched.waiting and sched.requests == {}
        total_preemptions += sched.num_preemptions
    assert total_preemptions > 0      # the workloads do exercise preemption


# -- finishing early: abort, EOS, stop tokens, min_tokens ---------------------

def test_abort_waiting_request():
    """finish_request on a waiting request removes it from the queue; it never runs."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=1)
    a = make_request("a", prompt_len=4, max_tokens=3)
    b = make_request("b", prompt_len=4, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert list(sched.waiting) == [b]
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert b.status is RequestStatus.FINISHED_ABORTED and b.status.finish_reason == "abort"
    assert not sched.waiting and "b" not in sched.requests
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is None
    assert sched.finish_request("nobody", RequestStatus.FINISHED_ABORTED) is None
    plans = run_to_completion(sched)
    assert all(e.request_id == "a" for p in plans for e in p.scheduled)
    assert b.num_output_tokens == 0
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_running_request_frees_its_blocks():
    """finish_request on a running request frees its blocks at once."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", prompt_len=6, max_tokens=10)
    b = make_request("b", prompt_len=3, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert kv.block_ids("a") == [0, 1]
    assert sched.finish_request("a", RequestStatus.FINISHED_ABORTED) is a
    assert sched.running == [b]
    assert kv.block_ids("a") == [] and kv.num_free_blocks == 7
    run_to_completion(sched)
    assert b.num_output_tokens == 3
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_while_step_in_flight_is_ignored_by_update():
    """A request aborted between schedule() and update() gets no token and keeps no blocks."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", prompt_len=5, max_tokens=10)
    b = make_request("b", prompt_len=5, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    plan = sched.schedule()
    sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    update = sched.update(plan, StepResult({e.request_id: SampledToken(TOK) for e in plan.scheduled}))
    assert update.with_new_token == [b]
    assert a.output_token_ids == [] and a.num_computed_tokens == 0
    assert a.status is RequestStatus.FINISHED_ABORTED
    assert kv.block_ids("a") == []
    run_to_completion(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_preempted_request():
    """finish_request on a preempted request removes it from waiting; nothing stays allocated."""
    sched, kv = make_scheduler(num_blocks=2, block_size=2)
    a = make_request("a", prompt_len=2, max_tokens=2)
    b = make_request("b", prompt_len=2, max_tokens=3)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)                    # a -> [0], b -> [1]
    plan, _ = step(sched)          # a needs a 2nd block: b is preempted
    assert plan.preempted == ["b"]
    assert b.status is RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert sched.finish_request("b", RequestStatus.FINISHED_ABORTED) is b
    assert b.status is RequestStatus.FINISHED_ABORTED
    assert not sched.waiting and "b" not in sched.requests
    run_to_completion(sched)
    assert a.num_output_tokens == 2
    assert kv.num_free_blocks == kv.num_blocks


def test_eos_stops_request():
    """Sampling EOS finishes the request with 'stop' and frees its blocks; others go on."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    a = make_request("a", prompt_len=3, max_tokens=10)
    b = make_request("b", prompt_len=3, max_tokens=4)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    step(sched)
    plan, update = step(sched, lambda e: EOS if e.request_id == "a" else TOK)
    assert update.finished == [a]
    assert a.output_token_ids == [TOK, TOK, EOS]
    assert a.status is RequestStatus.FINISHED_STOPPED and a.status.finish_reason == "stop"
    assert a.stop_reason is None
    assert kv.block_ids("a") == []
    run_to_completion(sched, lambda e: EOS if e.request_id == "a" else TOK)
    assert b.status is RequestStatus.FINISHED_LENGTH and b.num_output_tokens == 4
    assert kv.num_free_blocks == kv.num_blocks


def test_ignore_eos_keeps_generating():
    """With ignore_eos, EOS is just a token and the request runs to max_tokens."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    req = make_request("a", prompt_len=3, max_tokens=5, ignore_eos=True)
    sched.add_request(req)
    plans = run_to_completion(sched, always(EOS))
    assert len(plans) == 5
    assert req.output_token_ids == [EOS] * 5
    assert req.status is RequestStatus.FINISHED_LENGTH
    assert kv.num_free_blocks == kv.num_blocks


def test_stop_token_id_stops_with_reason():
    """A sampled stop_token_id finishes the request with 'stop' and records it as stop_reason."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    req = make_request("a", prompt_len=3, max_tokens=10, stop_token_ids=[42])
    sched.add_request(req)
    step(sched)
    _, update = step(sched, always(42))
    assert update.finished == [req]
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == 42
    assert kv.num_free_blocks == kv.num_blocks


def test_min_tokens_bans_eos_until_met():
    """While num_output_tokens < min_tokens the plan bans EOS and stop ids; then EOS stops it."""
    sched, kv = make_scheduler(num_blocks=8, block_size=4)
    req = make_request("a", prompt_len=3, max_tokens=10, min_tokens=3, stop_token_ids=[42])
    sched.add_request(req)

    def obedient(e: ScheduledRequest) -> int:   # a sampler that honours the ban, else picks EOS
        return TOK if EOS in e.banned_token_ids else EOS

    banned = []
    for _ in range(4):
        plan, _ = step(sched, obedient)
        banned.append((req.num_output_tokens - 1, entry(plan, "a").banned_token_ids))
    assert banned == [(0, [EOS, 42]), (1, [EOS, 42]), (2, [EOS, 42]), (3, [])]
    assert req.output_token_ids == [TOK, TOK, TOK, EOS]
    assert req.status is RequestStatus.FINISHED_STOPPED
    assert kv.num_free_blocks == kv.num_blocks


def test_min_tokens_ban_only_on_logits_rows():
    """A prefill chunk that samples nothing carries no banned ids; without min_tokens nothing is banned."""
    sched, kv = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8)
    a = make_request("a", prompt_len=12, max_tokens=2, min_tokens=1)
    b = make_request("b", prompt_len=2, max_tokens=2)
    sched.add_request(a)
    plan, _ = step(sched)
    assert summary(plan) == [("a", 0, 8, [0, 1], False)]
    assert entry(plan, "a").banned_token_ids == []
    sched.add_request(b)
    plan, _ = step(sched)
    assert entry(plan, "a").needs_logits and entry(plan, "a").banned_token_ids == [EOS]
    assert entry(plan, "b").needs_logits and entry(plan, "b").banned_token_ids == []
    run_to_completion(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_token_budget_default_depends_on_the_device():
    from sluice.backends.cpu.backend import CpuBackend
    from sluice.backends.cuda.backend import CudaBackend
    from sluice.config import EngineConfig
    assert EngineConfig.from_kwargs().scheduler.max_num_batched_tokens == CpuBackend.default_max_num_batched_tokens == 256
    assert EngineConfig.from_kwargs(device="cuda").scheduler.max_num_batched_tokens == \
        CudaBackend.default_max_num_batched_tokens == 2048
    assert EngineConfig.from_kwargs(max_num_batched_tokens=100).scheduler.max_num_batched_tokens == 100
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig.from_kwargs(max_num_batched_tokens=0)
