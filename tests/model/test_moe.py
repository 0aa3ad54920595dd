"""Mixture of experts (Qwen3-MoE, Mixtral) beyond float32's exact match (test_vs_transformers):
the experts under every linear method and KV cache of the CPU backend, and split over
tensor-parallel ranks."""
from __future__ import annotations

import pytest
import torch

from sluice import LLM, SamplingParams
from sluice.models.moe import SparseMoE
from tests.conftest import assert_all_blocks_free
from tests.model.test_vs_transformers import PROMPTS

PARAMS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def prompt_logprobs(llm) -> torch.Tensor:
    out = llm.generate([PROMPTS[2]], PARAMS)[0]
    return torch.tensor([next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]])


@pytest.fixture(scope="module")
def float32_logprobs(tiny_checkpoint):
    return {kind: prompt_logprobs(LLM(model=str(tiny_checkpoint(kind)), dtype="float32", num_blocks=32))
            for kind in ("qwen3-moe", "mixtral")}


# The mean |logprob - float32's| over the prompt the random tiny models' dense twins show,
# times about three (a routing flip moves a token's output further than rounding does).
@pytest.mark.parametrize("mode, bound, method", [
    ({}, 0.1, "KernelWeight"),
    ({"deterministic": True}, 0.1, "KernelWeight"),
    ({"quantization": "int8"}, 0.25, "KernelWeight"),
    ({"quantization": "w4a8"}, 1.5, "KernelWeight"),
    ({"kv_cache_dtype": "int8"}, 0.4, "KernelWeight"),
])
@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_experts_run_under_every_mode(kind, mode, bound, method, tiny_checkpoint, float32_logprobs, best_kernel_isa):
    llm = LLM(model=str(tiny_checkpoint(kind)), num_blocks=32, cpu_isa=best_kernel_isa, **mode)
    moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(type(e.gate_up_proj.method).__name__ == method and type(e.down_proj.method).__name__ == method
                        for m in moes for e in m.experts)
    if "quantization" in mode:  # (w4a8 keeps the first and last layers' weights in bf16: layer 1's experts)
        field = "w4a8" if mode["quantization"] == "w4a8" else "q_packed"
        middle = llm.engine.runner.model.model.layers[1].mlp
        assert all(getattr(lin.method, field) is not None for e in middle.experts
                   for lin in (e.gate_up_proj, e.down_proj)), "experts not quantized"
    err = (prompt_logprobs(llm) - float32_logprobs[kind]).abs().mean()
    assert err < bound, (kind, mode, float(err))
    assert_all_blocks_free(llm)


def test_experts_split_over_two_ranks(tiny_checkpoint):
    """Each rank holds every expert's half of the intermediate dimension: the same tokens as one process."""
    path = str(tiny_checkpoint("qwen3-moe"))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32", num_blocks=64).generate(PROMPTS, params)]
    tp = LLM(model=path, dtype="float32", tensor_parallel_size=2, num_blocks=64)
    try:
        assert [o.outputs[0].token_ids for o in tp.generate(PROMPTS, params)] == one
    finally:
        tp.engine.shutdown()
