"""No accepted input can fail an engine step: Hypothesis draws SamplingParams from the
whole accepted range (extremes included) and runs them, several requests a step, through
the real engine on a tiny model. Every request must finish normally and free its blocks.
And when a step does fail (a fault injected into the forward pass), only its requests
end, with finish_reason "error", and the engine goes on."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice import SamplingParams
from sluice.sampling_params import INT32_MAX
from tests.conftest import assert_all_blocks_free

VOCAB = 49152
EDGE_INTS = st.sampled_from([1, 2, VOCAB - 1, VOCAB, VOCAB + 1, INT32_MAX])


def params():
    return st.builds(
        SamplingParams,
        n=st.integers(1, 3),
        temperature=st.one_of(st.just(0.0), st.floats(1e-12, 1e4)),
        top_p=st.one_of(st.just(1.0), st.floats(1e-9, 1.0, exclude_min=True)),
        top_k=st.one_of(st.just(-1), st.integers(1, 64), EDGE_INTS),
        min_p=st.floats(0.0, 1.0),
        repetition_penalty=st.one_of(st.just(1.0), st.floats(1e-6, 1e4)),
        presence_penalty=st.floats(-2.0, 2.0),
        frequency_penalty=st.floats(-2.0, 2.0),
        seed=st.one_of(st.none(), st.integers(-2**63, 2**64 - 1)),
        max_tokens=st.integers(1, 4),
        min_tokens=st.integers(0, 1),
        stop=st.lists(st.text(min_size=1, max_size=3), max_size=3),
        stop_token_ids=st.lists(st.integers(0, VOCAB - 1), max_size=4),
        ignore_eos=st.booleans(),
        logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.floats(-100.0, 100.0),
                                                        max_size=3)),
        # 8 distinct ids: more than stop_token_ids and EOS can cover, which with min_tokens would
        # leave no token (a ValueError at add_request, tested in test_engine).
        allowed_token_ids=st.one_of(st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=8, max_size=8,
                                                        unique=True)),
        logprobs=st.one_of(st.none(), st.integers(0, 20), st.just(VOCAB)),
        prompt_logprobs=st.one_of(st.none(), st.integers(0, 5)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(batch=st.lists(st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), params()),
                      min_size=1, max_size=4))
def test_any_accepted_params_run_to_a_normal_finish(tiny_llm, batch):
    outs = tiny_llm.generate([prompt for prompt, _ in batch], [p for _, p in batch], use_tqdm=False)
    for (_, p), out in zip(batch, outs):
        assert out.error is None
        assert len(out.outputs) == p.n
        assert all(o.finish_reason in ("stop", "length") for o in out.outputs), [o.finish_reason for o in out.outputs]
    assert_all_blocks_free(tiny_llm)


def test_a_failed_step_ends_only_its_requests(tiny_llm):
    engine = tiny_llm.engine
    execute = engine.runner.execute
    poison = 4242

    def faulty(plan):
        if any(poison in e.token_ids for e in plan.scheduled):
            raise RuntimeError("injected fault")
        return execute(plan)
    engine.runner.execute = faulty
    seats = engine.scheduler.config.max_num_seqs
    try:
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        alone = tiny_llm.generate([[5, 6, 7]], greedy)[0].outputs[0].token_ids
        # One budget-sized step at a time: the poisoned prompt's step fails, the other
        # request (a step of its own) goes on and gives its solo tokens.
        engine.scheduler.config.max_num_seqs = 1
        engine.add_request("bad", [1, poison, 2], SamplingParams(n=2, max_tokens=4))
        engine.add_request("good", [5, 6, 7], greedy)
        finals = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert [o.finish_reason for o in finals["bad"].outputs] == ["error", "error"]
        assert "RuntimeError" in finals["bad"].error and "injected" not in finals["bad"].error
        assert finals["good"].error is None and finals["good"].outputs[0].token_ids == alone
    finally:
        engine.runner.execute = execute
        engine.scheduler.config.max_num_seqs = seats
    assert_all_blocks_free(tiny_llm)
