"""Prompt logprobs without a model: which positions each plan scores, storage by position
across preemption, no cached prefix read, and the shared logprob helper."""
from __future__ import annotations

import torch

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.scheduler import PromptLogprobs, SampledToken, Scheduler, StepResult
from sluice.request import Request
from sluice.sampling_params import SamplingParams
from sluice.worker.sampler import Sampler, token_logprobs
from tests.unit.test_sampler import meta_for

TOK = 7


def make(num_blocks=16, block_size=4, budget=64, caching=False):
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget), kv, num_blocks * block_size), kv


def request(rid, prompt, prompt_logprobs=None, max_tokens=3):
    return Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, prompt_logprobs=prompt_logprobs),
                   eos_token_ids={0}, max_tokens=max_tokens)


def fake_step(sched):
    """A runner that 'scores' prompt position p as logprob -p (rank p) for the next token."""
    plan = sched.schedule()
    plps = {}
    for e in plan.scheduled:
        if e.prompt_logprob_positions is not None:
            lo, hi = e.prompt_logprob_positions
            assert lo >= e.start_pos and hi <= e.start_pos + len(e.token_ids)
            plps[e.request_id] = PromptLogprobs(lo, [([e.prompt_token_ids[p + 1]], [-float(p)], p)
                                                     for p in range(lo, hi)])
    result = StepResult({e.request_id: SampledToken(TOK) for e in plan.scheduled if e.needs_logits}, plps)
    sched.update(plan, result)
    return plan


def test_chunks_score_each_position_once_and_the_last_token_samples():
    sched, _ = make(budget=8)
    prompt = list(range(100, 120))  # 20 tokens: chunks of 8, 8, 4
    req = request("a", prompt, prompt_logprobs=0)
    sched.add_request(req)
    spans = [fake_step(sched).scheduled[0].prompt_logprob_positions for _ in range(4)]
    assert spans == [(0, 8), (8, 16), (16, 19), None]  # position 19 is the sampling row
    assert req.prompt_logprobs[0] is None
    # Stored by position as the runner's rows: (ids, logprobs, rank), the prompt token first.
    assert [(e[0][0], e[1][0]) for e in req.prompt_logprobs[1:]] == [(prompt[p + 1], -float(p)) for p in range(19)]
    assert not req.needs_prompt_logprobs


def test_preempted_mid_prompt_resumes_scoring_where_it_stopped():
    sched, kv = make(budget=8)
    req = request("a", list(range(100, 120)), prompt_logprobs=1)
    sched.add_request(req)
    fake_step(sched)
    assert req.num_prompt_logprobs == 8
    sched._preempt(req)                       # recomputed from position 0 ...
    spans = [fake_step(sched).scheduled[0].prompt_logprob_positions for _ in range(3)]
    assert spans == [None, (8, 16), (16, 19)]  # ... but positions 0-7 are not scored again
    assert len(req.prompt_logprobs) == 20 and all(e is not None for e in req.prompt_logprobs[1:])
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert kv.num_free_blocks == kv.num_blocks


def test_no_cached_prefix_is_read_while_prompt_logprobs_are_due():
    sched, kv = make(caching=True)
    prompt = list(range(100, 117))
    sched.add_request(request("warm", prompt))
    while sched.has_unfinished_requests():
        fake_step(sched)
    assert kv.find_cached_prefix(request("probe", prompt)).num_tokens == 16
    scored = request("scored", prompt, prompt_logprobs=0)
    sched.add_request(scored)
    plan = fake_step(sched)
    assert plan.scheduled[0].start_pos == 0 and len(plan.scheduled[0].token_ids) == 17
    assert scored.num_cached_tokens == 0 and not scored.needs_prompt_logprobs
    # Once scored, a recompute (after preemption, say) may use the cache again.
    sched._preempt(scored)
    assert fake_step(sched).scheduled[0].start_pos == 16


def test_token_logprobs_is_the_samplers_arithmetic():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [2.0, -1.0, 0.5, 0.0]])
    ids, lps, ranks = token_logprobs(logits, torch.tensor([3, 2]), 2)
    lp = torch.log_softmax(logits, dim=-1)
    assert ranks.tolist() == [1, 2]  # ties do not count: rank = 1 + strictly greater
    assert ids[:, 0].tolist() == [3, 2] and ids[1, 1:].tolist() == [0, 2]
    assert torch.equal(lps[:, 0], lp[[0, 1], [3, 2]])
    # The sampler reports exactly what the helper computes, bit for bit.
    out = Sampler(torch.Generator().manual_seed(0))(logits, meta_for([SamplingParams(temperature=0)] * 2,
                                                                      max_num_logprobs=2, top_k=None, top_p=None,
                                                                      min_p=None))
    ids2, lps2, ranks2 = token_logprobs(logits, out.token_ids, 2)
    assert torch.equal(out.logprob_ids, ids2) and torch.equal(out.logprobs, lps2) and torch.equal(out.ranks, ranks2)
