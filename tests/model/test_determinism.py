"""Deterministic mode: a request's tokens and logprobs are bitwise those of its solo run,
whatever shares its steps, however its prompt is chunked, through preemption and
recompute, with prefix-cache hits, and in another process. SmolLM2 in bfloat16, the
default dtype, since that is what users run.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sluice import LLMEngine, SamplingParams

PROBES = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Explain in one paragraph why the sky is blue, as you would to a ten-year-old child who "
    "has just asked you on a long car journey and will not accept a vague answer.",
    "List three prime numbers greater than 100:",
    "Translate to German: The weather is nice today and we are going to the park.",
    " ".join(f"Item {i}: a line of an inventory of a hardware shop, bolts and nuts and screws." for i in range(12)),
    "Once upon a time, in a village at the edge of a great forest, there lived",
]
WORDS = ("river stone market engine window garden silver theory quiet number paper storm "
         "lantern orbit velvet harbor signal copper meadow riddle").split()


def probe_params(i: int, seeded: bool) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1000 + i, max_tokens=10, logprobs=3)
    return SamplingParams(temperature=0.0, max_tokens=10, logprobs=3)


def signature(output) -> tuple:
    """Tokens and every reported logprob, as exact floats."""
    o = output.outputs[0]
    lps = tuple(tuple(sorted((t, lp.logprob, lp.rank) for t, lp in step.items())) for step in o.logprobs)
    return tuple(o.token_ids), lps


def run_alone(engine: LLMEngine, rid: str, prompt: str, params: SamplingParams):
    engine.scheduler.config.max_num_batched_tokens = 2048
    engine.add_request(rid, prompt, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out = o
    return out


def run_trial(engine: LLMEngine, rng: random.Random, trial: int):
    """2-4 probes (greedy or seeded) among 0-31 neighbours, everyone arriving at a random
    step, under a random step budget. Returns {probe key: output} and probe outputs'
    cached-token counts."""
    engine.scheduler.config.max_num_batched_tokens = rng.choice([24, 48, 64, 128, 512, 2048])
    arrivals = []
    for i in rng.sample(range(len(PROBES)), rng.randint(2, 4)):
        seeded = rng.random() < 0.5
        arrivals.append((rng.randint(0, 12), f"t{trial}-probe{i}-{int(seeded)}", PROBES[i], probe_params(i, seeded)))
    for j in range(rng.randint(0, 31)):
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
        if rng.random() < 0.4:  # shares a probe's prefix: prefix-cache hits both ways
            text = rng.choice(PROBES)[: rng.randint(10, 120)] + " " + text
        params = rng.choice([
            SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 24)),
            SamplingParams(temperature=1.0, max_tokens=rng.randint(1, 24), logprobs=1),
            SamplingParams(temperature=0.7, seed=rng.randint(0, 99), max_tokens=rng.randint(1, 24)),
        ])
        arrivals.append((rng.randint(0, 30), f"t{trial}-n{j}", text, params))
    probes = run_arrivals(engine, arrivals, lambda rid: "probe" in rid)
    return {rid.split("-", 1)[1]: o for rid, o in probes.items()}


def run_arrivals(engine: LLMEngine, arrivals: list, want) -> dict:
    """Add each (step, request id, prompt, params) at its step, run until all finish, and
    return the finished outputs whose id `want` accepts, by id."""
    arrivals = sorted(arrivals, key=lambda a: a[0])
    outputs, step = {}, 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, params = arrivals.pop(0)
            engine.add_request(rid, prompt, params)
        for o in engine.step():
            if o.finished and want(o.request_id):
                outputs[o.request_id] = o
        step += 1
    return outputs


def solo_signatures(engine: LLMEngine) -> dict[str, tuple]:
    engine.reset_prefix_cache()
    return {f"probe{i}-{int(s)}": signature(run_alone(engine, f"solo{i}-{int(s)}", p, probe_params(i, s)))
            for i, p in enumerate(PROBES) for s in (False, True)}


def crowd_mismatches(engine: LLMEngine, solo: dict[str, tuple], trials: int, seed: int) -> tuple[int, int, int]:
    """(probe runs, probe runs that differ from solo, probe runs with prefix-cache hits)."""
    rng = random.Random(seed)
    runs = differ = cached = 0
    for trial in range(trials):
        for key, out in run_trial(engine, rng, trial).items():
            runs += 1
            differ += signature(out) != solo[key]
            cached += out.num_cached_tokens > 0
    return runs, differ, cached


@pytest.fixture(scope="module")
def det_engine(best_kernel_isa):
    """Deterministic mode on the best kernel build this CPU runs (conftest). 40 blocks of
    16 tokens: a crowd of 30 overflows it, forcing preemption and recompute.

    Speculation is off here (test_speculative.py covers it in deterministic mode, with a
    fixed gate). The default gate decides from measured step times whether to draft, and
    drafts take KV slots and change how many steps a request takes, so with it whether a
    crowd overflows the pool, and which arrival meets which, depended on how fast the
    machine ran the test. Without it every schedule here is a function of the requests and
    of the bits, which every kernel build shares: the same on every machine, every run."""
    return LLMEngine.from_kwargs(deterministic=True, num_blocks=40, max_model_len=512, cpu_isa=best_kernel_isa,
                                 speculative_method=None)


@pytest.fixture(scope="module")
def det_solo(det_engine):
    return solo_signatures(det_engine)


def test_probes_bitwise_equal_to_solo_in_random_crowds(det_engine, det_solo):
    preempted_before = det_engine.scheduler.num_preemptions
    # Eight trials: 18 probe runs, two preemptions (in the fifth trial) and four prefix
    # hits, the same on every machine (see det_engine); twelve took 44 s of the suite.
    runs, differ, cached = crowd_mismatches(det_engine, det_solo, trials=8, seed=0)
    assert runs >= 16
    assert differ == 0, f"{differ} of {runs} probe runs differ from their solo run"
    # The conditions the guarantee covers happened (a function of the seeded arrivals; the
    # next test makes each certain by construction).
    assert det_engine.scheduler.num_preemptions > preempted_before
    assert cached > 0
    kv = det_engine.kv
    assert kv.num_free_blocks == kv.num_blocks


def test_probes_bitwise_equal_to_solo_through_forced_preemption_and_prefix_hits(det_engine, det_solo):
    """Preemption and a prefix hit made certain by construction, whatever the tokens, the
    drafts or the machine's speed, with the probes as the ones preempted and hit."""
    e = det_engine
    rng = random.Random(7)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # The probes never stop early either (a seeded draw of EOS would free its block).
    probes = {"forced-probe0": (PROBES[0], probe_params(0, False).clone(ignore_eos=True)),
              "forced-probe1": (PROBES[1], probe_params(1, True).clone(ignore_eos=True))}
    solo = {rid: signature(run_alone(e, f"solo-{rid}", prompt, params)) for rid, (prompt, params) in probes.items()}
    # Ten neighbours of exactly three full blocks, then the two one-block probes: all
    # admitted in step 0 (32 of the 40 blocks). In step 1 each neighbour's first decode
    # needs a fourth block (a draft would stay inside it): ten blocks, eight free. FCFS
    # preempts the most recently admitted: both probes, which are recomputed later.
    assert all(len(e.tokenizer.encode(prompt)) <= 16 for prompt, _ in probes.values())
    e.scheduler.config.max_num_batched_tokens = 2048
    for j in range(10):
        e.add_request(f"forced-n{j}", [rng.randrange(3, 40000) for _ in range(48)], greedy)
    requests = {}
    for rid, (prompt, params) in probes.items():
        e.add_request(rid, prompt, params)
        requests[rid] = e.scheduler.requests[rid]  # (kept: a finished request leaves the scheduler)
    outputs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished and o.request_id in probes:
                outputs[o.request_id] = o
    assert {rid: r.num_preemptions > 0 for rid, r in requests.items()} == {rid: True for rid in probes}
    assert {rid: signature(o) for rid, o in outputs.items()} == solo
    # A prefix hit: a request sharing the long probe's first two blocks is computed in step
    # 0; the probe, arriving at step 1 (the pool nearly empty), reuses them.
    e.reset_prefix_cache()
    ids = e.tokenizer.encode(PROBES[3])
    assert len(ids) > 32
    got = run_arrivals(e, [(0, "share", ids[:32] + [rng.randrange(3, 40000) for _ in range(8)], greedy),
                           (1, "forced-probe3-0", PROBES[3], probe_params(3, False))], lambda rid: "probe" in rid)
    out = got["forced-probe3-0"]
    assert out.num_cached_tokens == 32
    assert signature(out) == det_solo["probe3-0"]
    assert e.kv.num_free_blocks == e.kv.num_blocks


def test_same_bits_in_another_process(det_engine, det_solo, best_kernel_isa):
    code = textwrap.dedent(f"""
        import json
        from sluice import LLMEngine
        from tests.model.test_determinism import PROBES, probe_params, run_alone, signature
        e = LLMEngine.from_kwargs(deterministic=True, num_blocks=40, max_model_len=512, cpu_isa={best_kernel_isa!r})
        out = {{s: signature(run_alone(e, "x", PROBES[3], probe_params(3, s == "1"))) for s in ("0", "1")}}
        print(json.dumps({{s: [list(sig[0]), [[list(x) for x in step] for step in sig[1]]]
                          for s, sig in out.items()}}))
    """)
    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for s in ("0", "1"):
        tokens, lps = got[s]
        expected = det_solo[f"probe3-{s}"]
        assert tuple(tokens) == expected[0]
        # JSON round-trips a float exactly (repr), so this is a bitwise comparison.
        assert tuple(tuple(tuple(x) for x in step) for step in lps) == expected[1]


def test_deterministic_mode_rejects_what_it_cannot_do():
    with pytest.raises(ValueError, match="deterministic"):
        LLMEngine.from_kwargs(deterministic=True, dtype="float16")
    with pytest.raises(ValueError, match="deterministic"):
        LLMEngine.from_kwargs(deterministic=True, device="cuda")


def test_rescoring_a_generation_gives_bitwise_its_logprobs(det_engine):
    """What an RL loop needs: the logprobs reported while sampling a sequence equal, bit
    for bit, those of scoring it afterwards as a prompt (prefill rows, not decode rows,
    in a batch of another shape, chunked differently)."""
    det_engine.scheduler.config.max_num_batched_tokens = 2048
    params = [SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=1.0, seed=5, max_tokens=12, logprobs=2)]
    for i, p in enumerate(params):
        gen = run_alone(det_engine, f"gen{i}", PROBES[3], p)
        seq = gen.prompt_token_ids + gen.outputs[0].token_ids
        for budget in (2048, 24):  # one chunk, or many
            det_engine.add_request(f"score{i}-{budget}", seq,
                                   SamplingParams(max_tokens=1, prompt_logprobs=2))
            det_engine.add_request(f"beside{i}-{budget}", PROBES[6], SamplingParams(max_tokens=5))
            det_engine.scheduler.config.max_num_batched_tokens = budget
            scored = None
            while det_engine.has_unfinished_requests():
                for o in det_engine.step():
                    if o.finished and o.request_id.startswith("score"):
                        scored = o
            n_prompt = len(gen.prompt_token_ids)
            for j, (tok, step) in enumerate(zip(gen.outputs[0].token_ids, gen.outputs[0].logprobs)):
                rescored = scored.prompt_logprobs[n_prompt + j]
                assert rescored[tok].logprob == step[tok].logprob, (i, budget, j)
                assert rescored[tok].rank == step[tok].rank
                assert {t: lp.logprob for t, lp in rescored.items()} == {t: lp.logprob for t, lp in step.items()}


def test_grammar_requests_bitwise_equal_alone_and_in_a_crowd(det_engine):
    """Structured outputs keep the guarantee: a constrained request's tokens and logprobs
    are its solo run's beside free and constrained neighbours, under chunking and
    preemption (the mask depends on its own tokens only)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    probes = [("Describe a person as JSON:", SamplingParams(temperature=0, max_tokens=24, logprobs=2,
                                                            structured_outputs={"json": schema})),
              ("A code:", SamplingParams(temperature=0.9, seed=11, max_tokens=12, logprobs=2,
                                         structured_outputs={"regex": "[A-Z]{2}-[0-9]{3,6}"}))]
    det_engine.reset_prefix_cache()
    solo = [signature(run_alone(det_engine, f"gsolo{i}", p, sp)) for i, (p, sp) in enumerate(probes)]
    rng = random.Random(1)
    preempted_before = det_engine.scheduler.num_preemptions
    for trial in range(3):
        det_engine.scheduler.config.max_num_batched_tokens = rng.choice([24, 64, 512])
        arrivals = [(rng.randint(0, 8), f"g{trial}-probe{i}", p, sp) for i, (p, sp) in enumerate(probes)]
        for j in range(24):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))
            sp = SamplingParams(temperature=0.7, seed=j, max_tokens=rng.randint(1, 20),
                                structured_outputs={"json": schema} if j % 3 == 0 else None)
            arrivals.append((rng.randint(0, 20), f"g{trial}-n{j}", text, sp))
        got = run_arrivals(det_engine, arrivals, lambda rid: "probe" in rid)
        assert [signature(got[f"g{trial}-probe{i}"]) for i in range(2)] == solo, \
            f"trial {trial}: a constrained probe differs from its solo run"
    assert det_engine.scheduler.num_preemptions > preempted_before
    assert det_engine.kv.num_free_blocks == det_engine.kv.num_blocks
