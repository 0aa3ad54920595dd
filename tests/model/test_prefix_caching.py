"""Prefix caching end to end: outputs never change, shared work is skipped, nothing leaks."""
from __future__ import annotations

import random

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free

GREEDY = dict(temperature=0, ignore_eos=True)


def sharing_workload(seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(3, 40000) for _ in range(50)]
    prompts = []
    for i in range(12):
        tail = [rng.randrange(3, 40000) for _ in range(rng.randint(1, 30))]
        prompts.append(system + tail if i % 3 else system[:rng.randint(5, 50)] + tail)
    prompts += [prompts[0], prompts[1]]  # exact repeats
    return prompts


def run(path, prompts, **kwargs):
    # Speculation off: the default gate drafts as measured step times say, and drafts take
    # KV slots, so whether the small cache preempts would depend on the machine's speed.
    llm = LLM(model=path, dtype="float32", speculative_method=None, **kwargs)
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, **GREEDY))
    return llm, [o.outputs[0].token_ids for o in outs], outs


def test_outputs_identical_with_caching_on_and_off(tiny_checkpoint):
    """Heavy sharing, chunked prefill and forced preemption: the same tokens either way."""
    path = str(tiny_checkpoint("llama"))
    prompts = sharing_workload()
    _, expected, _ = run(path, prompts, num_blocks=256, enable_prefix_caching=False)
    for kwargs in (dict(num_blocks=256), dict(num_blocks=256, max_num_batched_tokens=24),
                   dict(num_blocks=14, max_num_batched_tokens=40)):
        llm, got, outs = run(path, prompts, **kwargs)
        assert got == expected, kwargs
        assert llm.engine.kv.hit_tokens > 0, kwargs
        assert_all_blocks_free(llm)
    assert llm.engine.scheduler.num_preemptions > 0
    # Repeats of a cached prompt report what they reused.
    assert outs[-1].num_cached_tokens > 0


def test_second_turn_reuses_the_first_and_reports_cached_tokens(tiny_llm):
    prompt = list(range(100, 180))
    first = tiny_llm.generate([prompt], SamplingParams(max_tokens=8, **GREEDY))[0]
    second = tiny_llm.generate([prompt + first.outputs[0].token_ids + [7, 8, 9]],
                               SamplingParams(max_tokens=8, **GREEDY))[0]
    assert first.num_cached_tokens == 0 or first.num_cached_tokens % 16 == 0
    assert second.num_cached_tokens >= 80
    assert_all_blocks_free(tiny_llm)


def test_n4_shares_prompt_blocks(tiny_checkpoint):
    """n=4 computes the prompt once: clearly fewer blocks than four separate requests."""
    path = str(tiny_checkpoint("llama"))
    prompt = list(range(200, 300))  # 100 tokens = 6 full blocks + 4
    peaks = {}
    for name, caching in (("n4", False), ("separate", False)):
        llm = LLM(model=path, dtype="float32", num_blocks=128, enable_prefix_caching=caching)
        engine, peak = llm.engine, 0
        if name == "n4":
            engine.add_request("r", prompt, SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=10,
                                                           ignore_eos=True))
        else:
            for i in range(4):
                engine.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, seed=1 + i, max_tokens=10,
                                                                   ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv.num_blocks - engine.kv.num_free_blocks)
        peaks[name] = peak
        assert_all_blocks_free(llm)
    assert peaks["separate"] == 4 * 7
    assert peaks["n4"] <= 6 + 4 * 1 + 4  # shared prompt blocks, one own tail block each (+ growth)
    assert peaks["n4"] < peaks["separate"] / 2


def test_salt_isolates_and_reset_forgets(tiny_llm):
    engine = tiny_llm.engine
    prompt = list(range(300, 340))

    def hits_for(salt):
        before = engine.kv.hit_tokens
        engine.add_request(f"s{salt}{before}", prompt, SamplingParams(max_tokens=2, **GREEDY), cache_salt=salt)
        while engine.has_unfinished_requests():
            engine.step()
        return engine.kv.hit_tokens - before

    hits_for("alice")
    assert hits_for("alice") == 32
    assert hits_for("bob") == 0
    assert engine.reset_prefix_cache() > 0
    assert hits_for("alice") == 0
    assert_all_blocks_free(tiny_llm)
