"""Speculative decoding on real models: lossless (greedy token for token, seeded draws the
same, unseeded draws the same distribution), stop strings / max_tokens / logprobs / n > 1
as without it, bitwise in deterministic mode through crowds, chunking, preemption and
prefix hits, and no KV block left behind."""
from __future__ import annotations

import collections
import random

import pytest

from sluice import LLM, LLMEngine, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.model.test_determinism import run_arrivals, signature

CODE = '''def fibonacci(n):
    if n < 2:
        return n
    a, b = 0, 1
    for _ in range(n - 1):
        a, b = b, a + b
    return b


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result
'''
# Prompts whose continuations repeat their own text (drafts get accepted), and others.
PROMPTS = [
    f"Rewrite this code with type hints and keep everything else the same:\n{CODE}\n",
    "Repeat the following list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, "
    "apples, bananas, cherries,",
    "The capital of France is",
    "Item 1: bolts. Item 2: nuts. Item 3: screws. Item 4: bolts. Item 5: nuts. Item 6:",
]


def outputs(llm: LLM, prompts, params, speculative: bool = True):
    """(text, token ids, finish reason, stop reason) of every sample; speculative=False runs
    the same requests opted out, which never draft: the plain engine's path."""
    if not speculative:
        params = [p.clone(speculative=False) for p in params] if isinstance(params, list) \
            else params.clone(speculative=False)
    return [(o.text, tuple(o.token_ids), o.finish_reason, o.stop_reason)
            for r in llm.generate(prompts, params) for o in r.outputs]


@pytest.fixture()
def spec_f32(smollm2_llm):
    """The session's float32 engine (conftest; ngram speculation is the default), made to
    speculate whenever a draft exists, for the length of a test."""
    gate = smollm2_llm.engine.scheduler.spec.gate
    gate.always = True
    yield smollm2_llm
    gate.always = False


def test_greedy_is_token_for_token_the_plain_engine_float32(spec_f32):
    params = SamplingParams(temperature=0, max_tokens=48)
    want = outputs(spec_f32, PROMPTS, params, speculative=False)
    before = spec_f32.engine.scheduler.spec.stats.accepted
    assert outputs(spec_f32, PROMPTS, params) == want
    st = spec_f32.engine.scheduler.spec.stats
    # (64 accepted here: the first prompt's code is drafted from its own text.)
    assert st.accepted - before > 40, "drafts were hardly ever accepted: the test would prove nothing"
    assert_all_blocks_free(spec_f32)


def test_stops_lengths_logprobs_and_samples_as_without_speculation(spec_f32):
    cases = [
        SamplingParams(temperature=0, max_tokens=40, stop=["bananas, ch", "result"]),
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[28]),   # "="
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=7, max_tokens=30, n=2),
    ]
    # One batch of every case and prompt per engine (each sequence as without speculation).
    prompts = [p for _ in cases for p in PROMPTS]
    params = [c for c in cases for _ in PROMPTS]
    assert outputs(spec_f32, prompts, params) == outputs(spec_f32, prompts, params, speculative=False)
    lp = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    a = spec_f32.generate(PROMPTS[:2], lp)
    b = spec_f32.generate(PROMPTS[:2], lp.clone(speculative=False))
    for ra, rb in zip(a, b):
        oa, ob = ra.outputs[0], rb.outputs[0]
        assert oa.token_ids == ob.token_ids
        for sa, sb in zip(oa.logprobs, ob.logprobs):
            assert sa.keys() == sb.keys()
            for t in sa:
                # float32: the same to rounding (a verified row goes through another kernel)
                assert sa[t].logprob == pytest.approx(sb[t].logprob, abs=1e-4) and sa[t].rank == sb[t].rank
    assert_all_blocks_free(spec_f32)


def test_greedy_is_token_for_token_the_plain_engine_bfloat16(smollm2_source, best_kernel_isa):
    """bfloat16, the default dtype; the plain runs are the same engine's requests with
    speculative=False (they never draft: the plain engine's path)."""
    spec = LLM(dtype="bfloat16", kv_cache_memory=0.25, cpu_isa=best_kernel_isa, speculative_method="suffix",
               speculative_gate="always", num_speculative_tokens=6)
    want = outputs(spec, PROMPTS, SamplingParams(temperature=0, max_tokens=64, speculative=False))
    assert spec.engine.scheduler.spec.stats.drafted == 0
    assert outputs(spec, PROMPTS, SamplingParams(temperature=0, max_tokens=64)) == want
    assert spec.engine.scheduler.spec.stats.accepted > 50
    assert_all_blocks_free(spec)


class FixedPath:
    """Drafts the model's greedy continuation of the prompt, whatever was sampled so far
    (a tiny random model repeats nothing, so prompt lookup would draft nothing)."""

    def __init__(self, path: list[int]):
        self.path = path

    def propose(self, req, k):
        m = req.num_output_tokens
        return self.path[m:m + k]

    def request_finished(self, req):
        pass


def chi2_two_sample(a: collections.Counter, b: collections.Counter) -> tuple[float, int]:
    """The two-sample chi-square statistic over tokens seen >= 5 times in all (the rest in
    one bin), and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    big = [t for t in set(a) | set(b) if a[t] + b[t] >= 5]
    bins = [(a[t], b[t]) for t in big]
    rest = (na - sum(x for x, _ in bins), nb - sum(y for _, y in bins))
    if sum(rest):
        bins.append(rest)
    ka, kb = (nb / na) ** 0.5, (na / nb) ** 0.5
    return sum((x * ka - y * kb) ** 2 / (x + y) for x, y in bins), len(bins) - 1


def chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile for p = 0.001 (z = 3.09), by Wilson and Hilferty."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def test_unseeded_sampling_keeps_the_distribution(tiny_checkpoint):
    """Rejection sampling with a point-mass draft: each verified position samples the model's
    own distribution, and a draft is kept only where it equals that sample (probability
    p(draft); otherwise the sample is drawn from p without the draft, renormalised), so
    the output distribution is the plain engine's. Checked on a tiny model, 300 unseeded
    samples of 4 tokens from each engine: at each verified position a two-sample
    chi-square test does not reject equality at p = 0.001. (A verifier that kept every
    draft would put all of position 1 on one token and fail at any sample size.)"""
    path = str(tiny_checkpoint("llama"))
    # 32 at a time: each step's budget leaves room for everyone's drafts.
    plain = LLM(model=path, dtype="float32", num_blocks=512, seed=1, max_num_seqs=32)
    greedy = plain.generate(["1 2 3"], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0].token_ids
    spec = LLM(model=path, dtype="float32", num_blocks=512, seed=2, max_num_seqs=32, speculative_method="ngram",
               speculative_gate="always")
    spec.engine.scheduler.spec.proposer = FixedPath(list(greedy))
    params = SamplingParams(temperature=0.8, top_k=3, max_tokens=4)
    hist = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        hist[name] = [collections.Counter() for _ in range(4)]
        for r in llm.generate(["1 2 3"] * 300, params):
            for j, t in enumerate(r.outputs[0].token_ids):
                hist[name][j][t] += 1
    st = spec.engine.scheduler.spec.stats
    assert st.accepted > 75, f"only {st.accepted} drafts accepted: the test would prove little"
    for j in range(1, 4):
        stat, df = chi2_two_sample(hist["plain"][j], hist["spec"][j])
        assert df >= 1 and stat < chi2_critical(df), f"position {j}: chi-square {stat:.1f} on {df} df"
    assert_all_blocks_free(spec)


class DraftsAlways:
    """Drafts every step: the request's last k tokens again (a tiny random model repeats
    nothing, so prompt lookup would rarely draft; most of these are rejected, some kept)."""

    def propose(self, req, k):
        return (req.prompt_token_ids + req.output_token_ids)[-k:]

    def request_finished(self, req):
        pass


def test_preemption_and_aborts_mid_verification_leak_nothing(tiny_checkpoint):
    """A cache so small that verifying requests are preempted (and recomputed), and one
    aborted between planning and update: outputs as without speculation, every block free."""
    spec = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=6, speculative_gate="always")
    spec.engine.scheduler.spec.proposer = DraftsAlways()
    prompts = [" ".join(str(i * j) for j in range(12)) for i in range(1, 5)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    assert outputs(spec, prompts, params) == outputs(spec, prompts, params, speculative=False)
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.scheduler.spec.stats.drafted > 0
    eng = spec.engine
    for i, p in enumerate(prompts):
        eng.add_request(f"ab{i}", p, params)
    aborted = False
    while eng.has_unfinished_requests():
        plan = eng.scheduler.schedule()
        if not aborted and any(e.draft_token_ids for e in plan.scheduled):
            victim = next(e.request_id for e in plan.scheduled if e.draft_token_ids)
            result = eng.runner.execute(plan)
            eng.abort(victim)                 # while "its step runs"
            eng.outputs.process(eng.scheduler.update(plan, result))
            aborted = True
            continue
        eng.outputs.process(eng.scheduler.update(plan, eng.runner.execute(plan)))
    assert aborted
    assert_all_blocks_free(spec)


def test_deterministic_mode_bitwise_with_and_without_speculation(best_kernel_isa):
    """Each probe's tokens and logprobs, bitwise: alone without speculation, and with it in
    crowds, under small step budgets (chunked prompts), in a cache
    that forces preemption, with prefix hits."""
    kw = dict(deterministic=True, num_blocks=16, max_model_len=256, cpu_isa=best_kernel_isa)
    probes = {f"probe{i}-{s}": (p, SamplingParams(temperature=0.9, top_k=50, seed=100 + i, max_tokens=32,
                                                  logprobs=2) if s else
                                   SamplingParams(temperature=0, max_tokens=32, logprobs=2))
              for i, p in enumerate(PROMPTS) for s in (0, 1)}
    spec = LLMEngine.from_kwargs(**kw, speculative_method="suffix", speculative_gate="always")
    solo = {}
    for key, (p, params) in probes.items():  # alone, and without speculation (opted out)
        plain = params.clone(speculative=False)
        solo[key] = signature(run_arrivals(spec, [(0, key, p, plain)], lambda r: True)[key])
    assert spec.scheduler.spec.stats.drafted == 0
    spec.reset_prefix_cache()
    rng = random.Random(0)
    differ = runs = cached = 0
    for trial in range(2):
        spec.scheduler.config.max_num_batched_tokens = rng.choice([24, 64, 512])
        arrivals = [(rng.randint(0, 6), f"t{trial}-{key}", p, params) for key, (p, params) in probes.items()
                    if rng.random() < 0.6]
        for j in range(rng.randint(4, 12)):
            text = rng.choice(PROMPTS)[: rng.randint(20, 120)] + f" variant {j}"
            arrivals.append((rng.randint(0, 20), f"t{trial}-n{j}", text,
                             SamplingParams(temperature=0, max_tokens=rng.randint(4, 30))))
        for rid, out in run_arrivals(spec, arrivals, lambda r: "probe" in r).items():
            runs += 1
            differ += signature(out) != solo[rid.split("-", 1)[1]]
            cached += out.num_cached_tokens > 0
    assert runs >= 6
    assert differ == 0, f"{differ} of {runs} probe runs differ from the plain engine's solo run"
    assert spec.scheduler.num_preemptions > 0 and cached > 0
    assert spec.scheduler.spec.stats.accepted > 50
    assert spec.kv.num_free_blocks == spec.kv.num_blocks
