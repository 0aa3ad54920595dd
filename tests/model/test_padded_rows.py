"""How many rows a step runs (Backend.padded_rows): sluice's CPU kernels take any row
count as it is, so a step there runs its own tokens' rows and no more, with the bits a
padded step gives them; torch's ops (oneDNN builds a kernel per matrix shape) keep the
few padded sizes of worker/shapes.py."""
from __future__ import annotations

from sluice import LLM, SamplingParams
from sluice.worker.shapes import bucket

# Five requests: their decode steps have 5 rows, which shapes.bucket pads to 8.
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "1, 2, 3, 5, 8,",
           "Roses are red"]


def rows_per_step(llm: LLM, monkeypatch) -> list[int]:
    """Records the row count of every forward the engine's backend runs (until the test ends)."""
    backend, seen = llm.engine.runner.backend, []
    forward = backend.forward

    def counted(model, input_ids, *args, **kwargs):
        seen.append(int(input_ids.shape[0]))
        return forward(model, input_ids, *args, **kwargs)
    monkeypatch.setattr(backend, "forward", counted)
    return seen


def run(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    outs = llm.generate(PROMPTS, params)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def test_kernel_steps_run_their_own_rows_with_a_padded_steps_bits(tiny_checkpoint, best_kernel_isa, monkeypatch):
    llm = LLM(model=str(tiny_checkpoint("llama")), dtype="bfloat16", num_blocks=64, max_num_batched_tokens=16,
              cpu_isa=best_kernel_isa)
    backend = llm.engine.runner.backend
    assert backend.model_kernels is not None and backend.padded_rows(5) == 5 and backend.padded_rows(129) == 129
    seen = rows_per_step(llm, monkeypatch)
    own = run(llm)
    own_rows = list(seen)
    assert 5 in own_rows  # the five decodes, unpadded
    backend.padded_rows = bucket  # as a backend that pads would run it
    seen.clear()
    assert run(llm) == own
    assert 5 not in seen and sum(seen) > sum(own_rows)


def test_torch_ops_keep_the_padded_sizes(tiny_llm, monkeypatch):
    backend = tiny_llm.engine.runner.backend
    assert backend.model_kernels is None and backend.padded_rows(5) == 8
    seen = rows_per_step(tiny_llm, monkeypatch)
    run(tiny_llm)
    assert seen and all(n == bucket(n) for n in seen) and 8 in seen
