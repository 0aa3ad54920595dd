"""Asynchronous scheduling (the engine's overlap loop): step N is planned and launched
before step N - 1's tokens reach the host, and the outputs are the plain loop's, token for
token, through chunked prefill, preemption of requests whose token is still in flight,
prefix hits, aborts, stop conditions, seeded sampling, and the features that need their
tokens on the host first (grammars, penalties, drafts). On a CPU a launch has computed
the step when it returns, so nothing overlaps in time here, but the order of the work,
the pending-token bookkeeping and the device-side copy of the inputs are the GPU's."""
from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams
from sluice.config import EngineConfig
from tests.conftest import assert_all_blocks_free
from tests.model.test_engine import prompts_of_lengths

GREEDY = dict(temperature=0, ignore_eos=True)


def mixed_requests(host_bound: bool):
    """Greedy requests of many lengths, seeded samples (n = 2) with logprobs, a
    prefill-only request, stop tokens, a stop string, a prompt sharing two blocks with
    another (a prefix hit); host_bound: also penalties and a grammar, whose next step
    needs their tokens on the host (the step in flight is collected first)."""
    prompts = prompts_of_lengths(None, [5, 40, 90, 3, 17, 60, 33, 21], seed=11)
    params = [SamplingParams(max_tokens=m, **GREEDY) for m in (20, 7, 30, 1, 25, 12)]
    params += [SamplingParams(temperature=0.8, seed=5, max_tokens=15, n=2, logprobs=2),
               SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=1)]
    prompts += [prompts[1][:32] + prompts[0], prompts[5], prompts[6]]
    params += [SamplingParams(max_tokens=18, **GREEDY),
               SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[5, 17, 300]),
               SamplingParams(temperature=0, max_tokens=40, stop=["e"])]
    if host_bound:
        prompts += prompts_of_lengths(None, [12, 70], seed=12)
        params += [SamplingParams(temperature=0, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5),
                   SamplingParams(temperature=0, max_tokens=20, structured_outputs={"regex": "[a-z]{3,12}"})]
    return prompts, params


def tokens(outs):
    return [[(c.token_ids, c.finish_reason, c.text) for c in o.outputs] for o in outs]


class Recorder:
    """The runner's launches and collects in order; which launches found a step in flight,
    and the victims of preemption that had a token in flight."""

    def __init__(self, llm):
        engine = llm.engine
        runner, sched = engine.runner, engine.scheduler
        self.events: list[tuple[str, int]] = []
        self.preempted_in_flight = 0
        launch, collect, preempt = runner.launch, runner.collect, sched._preempt

        def rec_launch(plan, prev=None):
            self.events.append(("launch", id(plan)))
            return launch(plan, prev)

        def rec_collect(launched):
            self.events.append(("collect", id(launched.plan)))
            return collect(launched)

        def rec_preempt(req):
            self.preempted_in_flight += req.num_pending > 0
            return preempt(req)
        runner.launch, runner.collect, sched._preempt = rec_launch, rec_collect, rec_preempt

    @property
    def overlapped(self) -> int:
        """Launches made while an earlier launched step was not collected yet."""
        open_, n = set(), 0
        for kind, plan in self.events:
            if kind == "launch":
                n += bool(open_)
                open_.add(plan)
            else:
                open_.discard(plan)
        return n


@pytest.mark.parametrize("num_blocks, host_bound", [(64, False), (12, False), (64, True)])
def test_same_outputs_as_the_plain_loop(tiny_checkpoint, num_blocks, host_bound):
    """A roomy pool, and one so small that requests are preempted, some while their next
    token is in flight, and requests that need their tokens on the host beside the others:
    every token, finish reason and text equal the plain loop's, and every block is free
    at the end."""
    path = str(tiny_checkpoint("llama"))
    prompts, params = mixed_requests(host_bound)
    kwargs = dict(model=path, dtype="float32", num_blocks=num_blocks, max_num_batched_tokens=32,
                  speculative_method=None)
    plain = LLM(**kwargs, async_scheduling=False)
    want = plain.generate(prompts, params)
    llm = LLM(**kwargs, async_scheduling=True)
    assert llm.engine.overlap and not plain.engine.overlap
    rec = Recorder(llm)
    got = llm.generate(prompts, params)
    assert tokens(got) == tokens(want)
    for g, w in zip(got, want):
        assert g.num_cached_tokens == w.num_cached_tokens
        for a, b in zip(g.outputs, w.outputs):
            if b.logprobs:
                assert [sorted(x) for x in a.logprobs] == [sorted(x) for x in b.logprobs]
    assert rec.overlapped > 5, rec.events
    if num_blocks == 64:
        assert got[8].num_cached_tokens == 32
    else:
        assert llm.engine.scheduler.num_preemptions > 0 and rec.preempted_in_flight > 0
    assert_all_blocks_free(llm)


def test_each_step_is_launched_before_the_previous_is_collected(tiny_checkpoint):
    """The overlap loop's order: launch N, then collect N - 1; the outputs of step N - 1
    come from the step() that launched N, and a decode's input is the token sampled by
    the step before, which the host had not read when it was launched."""
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=32, async_scheduling=True,
              speculative_method=None)
    rec = Recorder(llm)
    engine = llm.engine
    engine.add_request("a", prompts_of_lengths(None, [9], seed=1)[0], SamplingParams(max_tokens=4, **GREEDY))
    assert engine.step() == []          # launched the prefill; nothing collected yet
    first = engine.step()               # launched decode 1, collected the prefill: token 1
    assert [len(o.outputs[0].token_ids) for o in first] == [1]
    assert rec.events[:3] == [("launch", rec.events[0][1]), ("launch", rec.events[1][1]),
                              ("collect", rec.events[0][1])]
    outs = first
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    plain = LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=32, async_scheduling=False)
    want = plain.generate([prompts_of_lengths(None, [9], seed=1)[0]], SamplingParams(max_tokens=4, **GREEDY))
    assert outs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_abort_and_max_tokens_with_a_step_in_flight(tiny_checkpoint):
    """A request aborted while its next token is being computed ends at once, its blocks
    free; its neighbours' tokens are the plain loop's. A request whose in-flight token is
    its last (max_tokens) is not planned again."""
    path = str(tiny_checkpoint("llama"))
    prompts = prompts_of_lengths(None, [12, 30, 7], seed=4)
    llm = LLM(model=path, dtype="float32", num_blocks=32, async_scheduling=True, speculative_method=None)
    engine = llm.engine
    plans, launch = [], engine.runner.launch
    engine.runner.launch = lambda plan, prev=None: plans.append(plan) or launch(plan, prev)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=[10, 2, 10][i], **GREEDY))
    finals = {}

    def step():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    for _ in range(4):
        step()
    assert engine._inflight is not None and "r0" in engine._inflight.rows
    engine.abort("r0")
    while engine.has_unfinished_requests():
        step()
    assert finals["r0"].outputs[0].finish_reason == "abort"
    # r1 sampled in exactly two steps: its second token, in flight, was known to be its last.
    assert sum(e.needs_logits for p in plans for e in p.scheduled if e.request_id == "r1") == 2
    plain = LLM(model=path, dtype="float32", num_blocks=32, async_scheduling=False)
    want = plain.generate(prompts[1:], [SamplingParams(max_tokens=m, **GREEDY) for m in (2, 10)])
    assert [finals[r].outputs[0].token_ids for r in ("r1", "r2")] == [w.outputs[0].token_ids for w in want]
    assert_all_blocks_free(llm)


def test_operations_between_steps_collect_the_step_in_flight(tiny_checkpoint):
    """A weight update (and a prefix-cache reset) collects the step in flight first; its
    outputs come with the next step, and the requests finish as the plain loop's do."""
    path = str(tiny_checkpoint("llama"))
    prompt = prompts_of_lengths(None, [20], seed=6)[0]
    want = LLM(model=path, dtype="float32", num_blocks=32).generate([prompt], SamplingParams(max_tokens=8, **GREEDY))
    llm = LLM(model=path, dtype="float32", num_blocks=32, async_scheduling=True, speculative_method=None)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=8, **GREEDY))
    engine.step()
    engine.step()
    assert engine._inflight is not None
    from safetensors.torch import load_file
    same = {n: t for n, t in load_file(f"{path}/model.safetensors").items() if n.endswith("norm.weight")}
    engine.update_weights(same)  # the same values: the request goes on to the same tokens
    assert engine._inflight is None and engine.has_unfinished_requests()
    engine.reset_prefix_cache()
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_the_default_follows_the_backend_and_tensor_parallel_refuses_it():
    assert EngineConfig.from_kwargs(model="x").scheduler.async_scheduling is False  # a CPU: nothing overlaps
    with pytest.raises(ValueError, match="async_scheduling needs tensor_parallel_size=1"):
        EngineConfig.from_kwargs(model="x", async_scheduling=True, tensor_parallel_size=2)
    assert EngineConfig.from_kwargs(model="x", tensor_parallel_size=2).scheduler.async_scheduling is False
