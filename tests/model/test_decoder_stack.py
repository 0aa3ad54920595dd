"""The C++ decoder stack (kernels.DecoderStack) gives the same bits as the Python loop
over the same kernels, and runs on the steps it is meant for."""
from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams


PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived",
           "def fibonacci(n):"]


class CountingStack:
    """Wraps the stack (the model's fast_forward) to count the steps it ran."""

    def __init__(self, stack):
        self.stack, self.calls = stack, 0

    def __call__(self, *args):
        out = self.stack(*args)
        self.calls += out is not None
        return out


def run(llm: LLM, params: SamplingParams):
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


@pytest.mark.parametrize("kind,quantization,deterministic", [
    ("llama", None, False), ("qwen2", None, False), ("llama", "int8", False), ("llama3-rope", None, True),
    ("llama-4layers", "w8a8", False), ("llama-4layers", "w4a8", True),
])
def test_stack_matches_python_loop_bitwise(tiny_checkpoint, kind, quantization, deterministic, kernel_isa):
    llm = LLM(model=str(tiny_checkpoint(kind)), dtype="bfloat16", num_blocks=64, quantization=quantization,
              deterministic=deterministic, max_num_batched_tokens=16, cpu_isa=kernel_isa)
    model = llm.engine.runner.model
    assert model.fast_forward is not None
    counter = model.fast_forward = CountingStack(model.fast_forward)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    with_stack = run(llm, params)
    assert counter.calls > 0
    model.fast_forward = None
    assert run(llm, params) == with_stack


def test_float32_has_no_stack(tiny_llm):
    assert tiny_llm.engine.runner.model.fast_forward is None


def _stack_and_a_step(tiny_checkpoint, kernel_isa):
    """A w4a8 tiny model's stack and the arguments of one decode step it ran."""
    llm = LLM(model=str(tiny_checkpoint("llama-4layers")), dtype="bfloat16", num_blocks=64, quantization="w4a8",
              max_num_batched_tokens=16, cpu_isa=kernel_isa)
    model = llm.engine.runner.model
    stack, seen = model.fast_forward, []

    def grab(x, cos, sin, meta, kv_caches):
        out = stack(x, cos, sin, meta, kv_caches)
        if out is not None:
            seen.append((x, cos, sin, kv_caches, meta.slot_mapping, meta.block_tables, meta.query_start_loc,
                         meta.seq_lens, None))
        return out

    model.fast_forward = grab
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    model.fast_forward = stack
    return llm, stack.stack, seen[-1], params, first


def test_stack_gives_the_same_bits_on_one_thread_and_on_its_team(tiny_checkpoint, kernel_isa):
    """The layers run in one thread team (team.h) that splits each kernel's work as
    at::parallel_for does; the split never changes a number."""
    import torch
    _, stack, args, _, _ = _stack_and_a_step(tiny_checkpoint, kernel_isa)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        on_team = stack.forward(*args)
        torch.set_num_threads(1)
        alone = stack.forward(*args)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(on_team, alone)


def test_an_error_inside_the_team_is_raised_and_the_next_steps_run(tiny_checkpoint, kernel_isa):
    """A kernel's error in the middle of the layers (here the last layer's cache has the
    wrong kv heads) ends the team's region and reaches Python as an error; the threads are
    not left waiting, so the engine's next requests run as before."""
    import torch
    llm, stack, args, params, first = _stack_and_a_step(tiny_checkpoint, kernel_isa)
    kv = list(args[3])
    k, v = kv[-1]
    kv[-1] = (k[:1], v[:1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(RuntimeError, match="cache kv heads"):
            stack.forward(*args[:3], kv, *args[4:])
    finally:
        torch.set_num_threads(threads)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == first


def test_the_stacks_profile_counts_each_kind_and_changes_no_bits(tiny_checkpoint, kernel_isa):
    """set_profile times each kind of kernel call (benchmarks/step_profile.py's table): off
    by default, it counts the calls made while on, a reset empties it, and the clock never
    changes a number."""
    import torch
    _, stack, args, _, _ = _stack_and_a_step(tiny_checkpoint, kernel_isa)
    names, seconds, calls = stack.profile()
    assert names == ["qkv", "rope_write_kv", "attention", "o", "add_rms_norm", "gate_up", "silu_and_mul", "down"]
    assert calls == 0 and seconds == [0.0] * len(names)  # the steps above ran with the clock off
    plain = stack.forward(*args)
    stack.set_profile(True)
    try:
        timed = [stack.forward(*args) for _ in range(3)]
    finally:
        stack.set_profile(False)
    assert all(torch.equal(t, plain) for t in timed)
    _, seconds, calls = stack.profile()
    assert calls == 3 and all(s >= 0 for s in seconds) and sum(seconds) > 0
    stack.forward(*args)  # off again: nothing added
    assert stack.profile()[2] == 3
    stack.reset_profile()
    assert stack.profile()[1:] == ([0.0] * len(names), 0)
