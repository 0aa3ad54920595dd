"""The engine on each lower build (avx512_vnni, avx2_vnni, avx2) gives the best AVX-512
build's tokens and logprobs, bit for bit, in every mode the kernels run (the builds compile
one source: tests/unit/test_isa_builds.py checks each op). Runs where the CPU executes an
AVX-512 build and a lower one."""
from __future__ import annotations

import pytest

from sluice import LLM, SamplingParams
from tests.conftest import ALL_KERNEL_ISAS, LOWER_ISAS as LOWER

pytestmark = pytest.mark.skipif(not LOWER, reason="needs a CPU that runs an AVX-512 build and a lower one")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived", "def fibonacci(n):",
           "1, 2, 3, 5, 8, 13,"]


@pytest.mark.parametrize("mode", [dict(), dict(quantization="int8"), dict(quantization="w8a8", kv_cache_dtype="int8"),
                                  dict(deterministic=True), dict(deterministic=True, dtype="float32")])
def test_lower_builds_give_the_best_builds_bits(tiny_checkpoint, mode):
    runs = {}
    best = ALL_KERNEL_ISAS[0]
    for isa in (best, *LOWER):
        llm = LLM(model=str(tiny_checkpoint("llama-4layers")), num_blocks=64, max_num_batched_tokens=16,
                  cpu_isa=isa, **mode)
        assert llm.engine.backend.isa == isa
        outs = []
        for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
                       SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True, logprobs=1)):
            outs.append([(o.outputs[0].token_ids,
                          None if o.outputs[0].logprobs is None else
                          [sorted((t, lp.logprob) for t, lp in d.items()) for d in o.outputs[0].logprobs])
                         for o in llm.generate(PROMPTS, params)])
        runs[isa] = outs
    for isa in LOWER:
        assert runs[isa] == runs[best], isa
