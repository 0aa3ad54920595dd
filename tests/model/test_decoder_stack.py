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
