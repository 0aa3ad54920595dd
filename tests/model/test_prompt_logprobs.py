"""Prompt logprobs (SamplingParams.prompt_logprobs) against transformers, and unchanged by
chunking, preemption, prefix caching and n > 1."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.model.test_engine import record_plans

GREEDY = dict(temperature=0, ignore_eos=True)
ATOL = 1e-5


def random_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 40000) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    """Log-softmax of transformers' full-sequence forward: row p scores token p + 1."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), torch_dtype=torch.float32).eval()

    def ref(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids]), use_cache=False).logits[0].float(), dim=-1)
    return ref


def check_prompt_logprobs(plp, ids, ref_lp, k):
    """One request's prompt logprobs against the reference, entry by entry."""
    assert plp is not None and len(plp) == len(ids)
    assert plp[0] is None
    for p in range(1, len(ids)):
        entry, ref, tid = plp[p], ref_lp[p - 1], ids[p]
        assert entry is not None and tid in entry, p
        got = entry[tid]
        assert abs(got.logprob - float(ref[tid])) <= ATOL, (p, got.logprob, float(ref[tid]))
        # Rank = 1 + the count of strictly greater logprobs, up to ties within ATOL (the
        # upper count includes the token itself, hence no + 1).
        lo = int((ref > ref[tid] + ATOL).sum()) + 1
        hi = int((ref > ref[tid] - ATOL).sum())
        assert lo <= got.rank <= hi, (p, got.rank, lo, hi)
        # The top k: ranks 1..k in order, each the reference's j-th largest value.
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
        assert [r for r, _, _ in top] == list(range(1, k + 1)), (p, top)
        ref_sorted = ref.topk(k).values if k else []
        for (rank, t, lp), expected in zip(top, ref_sorted):
            assert abs(lp - float(expected)) <= ATOL and abs(lp - float(ref[t])) <= ATOL, (p, rank, t)
        assert len(entry) in (k, k + 1)
        assert all(lp.decoded_token is not None for lp in entry.values())


def test_prompt_logprobs_match_transformers(tiny_checkpoint, reference):
    """One batch: prompts of 1, 2, 37 and 300 tokens (300 > one 256-row slice), different k
    per request, and a request without prompt logprobs beside them."""
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64)
    prompts = random_prompts([300, 37, 2, 1, 20])
    ks = [3, 0, 5, 2, None]
    params = [SamplingParams(max_tokens=4, prompt_logprobs=k, **GREEDY) for k in ks]
    outs = llm.generate(prompts, params)
    for ids, k, out in zip(prompts, ks, outs):
        if k is None:
            assert out.prompt_logprobs is None
            continue
        check_prompt_logprobs(out.prompt_logprobs, ids, reference(ids), k)
    assert outs[3].prompt_logprobs == [None]
    # Asking for prompt logprobs changes nothing about the generated tokens.
    plain = llm.generate(prompts, SamplingParams(max_tokens=4, **GREEDY))
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert_all_blocks_free(llm)


def test_chunked_prefill_and_preemption_give_the_same_values(tiny_checkpoint):
    """A 16-token budget splits every prompt into chunks, each contributing its rows; a
    10-block cache preempts requests halfway through their prompts. Each prompt position
    is scored exactly once and the values equal the unchunked run's."""
    path = str(tiny_checkpoint("llama"))
    prompts = random_prompts([100, 60, 45, 70], seed=1)
    params = SamplingParams(max_tokens=30, prompt_logprobs=2, **GREEDY)
    expected = LLM(model=path, dtype="float32", num_blocks=64).generate(prompts, params)
    # Speculation off: its gate follows measured step times, and drafts (KV slots, budget)
    # would make whether anyone is preempted depend on the machine's speed.
    llm = LLM(model=path, dtype="float32", num_blocks=10, max_num_batched_tokens=16, speculative_method=None)
    plans = record_plans(llm)
    outs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    scored: Counter[str] = Counter()
    chunks: Counter[str] = Counter()
    for plan in plans:
        for e in plan.scheduled:
            if e.prompt_logprob_positions is not None:
                lo, hi = e.prompt_logprob_positions
                scored[e.request_id] += hi - lo
                chunks[e.request_id] += 1
    for ids, want, got in zip(prompts, expected, outs):
        assert scored[got.request_id] == len(ids) - 1, "a prompt position was scored twice or not at all"
        assert chunks[got.request_id] >= len(ids) // 16
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert len(got.prompt_logprobs) == len(ids) and got.prompt_logprobs[0] is None
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            for tid in a:
                assert abs(a[tid].logprob - b[tid].logprob) <= ATOL
                assert a[tid].rank == b[tid].rank
    assert_all_blocks_free(llm)


def test_cached_prefix_is_not_read_but_is_shared(tiny_llm, reference):
    """A request asking for prompt logprobs scores its whole prompt even when a prefix is
    cached; its own blocks still serve later requests."""
    engine = tiny_llm.engine
    shared = random_prompts([80], seed=2)[0]  # 5 full blocks
    a, b, c = (shared + tail for tail in random_prompts([7, 9, 5], seed=3))
    first = tiny_llm.generate([a], SamplingParams(max_tokens=2, **GREEDY))[0]
    hits = engine.kv.hit_tokens
    second = tiny_llm.generate([b], SamplingParams(max_tokens=2, prompt_logprobs=1, **GREEDY))[0]
    assert second.num_cached_tokens == 0 and engine.kv.hit_tokens == hits
    check_prompt_logprobs(second.prompt_logprobs, b, reference(b), 1)
    third = tiny_llm.generate([c], SamplingParams(max_tokens=2, **GREEDY))[0]
    assert third.num_cached_tokens == 80
    assert first.prompt_logprobs is None and third.prompt_logprobs is None
    # With only the prompt-logprobs request's blocks cached, a later request reuses them.
    engine.reset_prefix_cache()
    d, e = (shared + tail for tail in random_prompts([4, 6], seed=4))
    tiny_llm.generate([d], SamplingParams(max_tokens=2, prompt_logprobs=0, **GREEDY))
    assert tiny_llm.generate([e], SamplingParams(max_tokens=2, **GREEDY))[0].num_cached_tokens == 80
    assert_all_blocks_free(tiny_llm)


def test_n3_reports_the_prompt_once_and_scores_it_once(tiny_llm, reference):
    ids = random_prompts([40], seed=5)[0]
    plans = record_plans(tiny_llm)
    try:
        out = tiny_llm.generate([ids], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5,
                                                      ignore_eos=True, prompt_logprobs=2))[0]
    finally:
        del tiny_llm.engine.runner.execute  # back to the class method
    assert len(out.outputs) == 3
    check_prompt_logprobs(out.prompt_logprobs, ids, reference(ids), 2)
    scored = [e for p in plans for e in p.scheduled if e.prompt_logprob_positions is not None]
    assert sum(hi - lo for lo, hi in (e.prompt_logprob_positions for e in scored)) == len(ids) - 1
    assert {e.request_id for e in scored} == {f"{out.request_id}#0"}
    assert_all_blocks_free(tiny_llm)


def test_rescoring_a_generation_repeats_its_logprobs(tiny_llm):
    """Generated tokens scored again as a prompt: the same logprobs and ranks (one shared
    computation; exact equality is the deterministic mode's business)."""
    ids = random_prompts([12], seed=6)[0]
    gen = tiny_llm.generate([ids], SamplingParams(max_tokens=10, logprobs=2, **GREEDY))[0].outputs[0]
    seq = ids + gen.token_ids
    again = tiny_llm.generate([seq], SamplingParams(max_tokens=1, prompt_logprobs=2, **GREEDY))[0]
    for i, tid in enumerate(gen.token_ids):
        before, after = gen.logprobs[i], again.prompt_logprobs[len(ids) + i]
        assert before.keys() == after.keys()
        for t in before:
            assert abs(before[t].logprob - after[t].logprob) <= ATOL
            assert before[t].rank == after[t].rank
    assert_all_blocks_free(tiny_llm)


def test_abort_during_the_prompt_frees_everything(tiny_checkpoint):
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=32, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("r", random_prompts([100], seed=8)[0], SamplingParams(max_tokens=5, prompt_logprobs=1))
    engine.step()
    engine.step()
    engine.abort("r")
    (out,) = engine.step()
    assert out.finished and out.outputs[0].finish_reason == "abort"
    # Partial: the positions scored so far, None for the rest.
    assert out.prompt_logprobs[0] is None and out.prompt_logprobs[1] is not None
    assert out.prompt_logprobs[32] is not None and out.prompt_logprobs[33] is None
    assert_all_blocks_free(llm)


def test_max_tokens_0_scores_the_prompt_and_generates_nothing(tiny_checkpoint, reference):
    """A prefill-only request (max_tokens=0) goes through the scheduler like any other, in
    a batch with generating ones and in chunks: its prompt is scored, no token sampled,
    it finishes with "length"; its blocks serve the prefix cache afterwards."""
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=64, max_num_batched_tokens=32,
              speculative_method=None)
    plans = record_plans(llm)
    prompts = random_prompts([70, 20, 1, 33], seed=9)
    params = [SamplingParams(max_tokens=0, prompt_logprobs=2, **GREEDY), SamplingParams(max_tokens=5, **GREEDY),
              SamplingParams(max_tokens=0, prompt_logprobs=0, **GREEDY), SamplingParams(max_tokens=0, **GREEDY)]
    outs = llm.generate(prompts, params)
    for ids, p, out in zip(prompts, params, outs):
        (c,) = out.outputs
        if p.max_tokens == 0:
            assert c.token_ids == [] and c.text == "" and c.finish_reason == "length", c
        else:
            assert len(c.token_ids) == 5
    check_prompt_logprobs(outs[0].prompt_logprobs, prompts[0], reference(prompts[0]), 2)
    assert outs[2].prompt_logprobs == [None] and outs[3].prompt_logprobs is None
    # No logits row was asked for a prefill-only request, and its prompt took > 1 chunk.
    zero = {outs[i].request_id for i in (0, 2, 3)}
    assert not any(e.needs_logits for plan in plans for e in plan.scheduled if e.request_id in zero)
    assert sum(1 for plan in plans for e in plan.scheduled if e.request_id == outs[0].request_id) >= 3
    assert_all_blocks_free(llm)
    # Its full blocks were cached: a request sharing them reuses them.
    again = llm.generate([prompts[0][:64] + [5, 6]], SamplingParams(max_tokens=1, **GREEDY))[0]
    assert again.num_cached_tokens == 64
    # It may fill the context (nothing is generated), but not pass it; a negative count stays refused.
    limit = llm.engine.max_model_len
    full = llm.generate([[7] * limit], SamplingParams(max_tokens=0, **GREEDY))[0]
    assert full.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[7] * (limit + 1)], SamplingParams(max_tokens=0, **GREEDY))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("value", [-1, 1.5, "2"])
def test_bad_prompt_logprobs_name_the_field(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)
