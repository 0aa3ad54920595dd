"""The CUDA backend end to end: the engine through its Triton kernels (paged attention for
prompt chunks and decodes together, split-K decode, RoPE with the K/V write, the norms and
SwiGLU) gives the torch reference path's greedy tokens on the tiny model, through chunked
prefill and prefix hits; what it cannot run is refused in one line. Without a GPU the
backend runs on CPU tensors under Triton's interpreter (tests/conftest.py sets it), with
the device's other parts (graphs, memory sizing) off; on a GPU (benchmarks/gpu_check.sh)
the same tests run on it."""
from __future__ import annotations

import pytest
import torch

from sluice import LLM, SamplingParams
from tests.conftest import assert_all_blocks_free
from tests.model.test_engine import prompts_of_lengths

pytest.importorskip("triton")

GPU = torch.cuda.is_available()
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture
def cuda_family(monkeypatch):
    """The device the CUDA backend runs on here: the GPU, or the CPU under the
    interpreter (select.py's family for "cpu" is then the CUDA one, for this test)."""
    if GPU:
        return "cuda"
    from sluice.backends import select
    monkeypatch.setitem(select.FAMILIES, "cpu", ("sluice.backends.cuda.backend", "CudaBackend"))
    return "cpu"


def test_triton_path_gives_the_torch_paths_greedy_tokens(tiny_checkpoint, cuda_family, tiny_llm):
    path = str(tiny_checkpoint("llama"))
    prompts = prompts_of_lengths(None, [5, 17, 40, 63, 9], seed=3)
    prompts += [prompts[2][:32] + prompts[4]]  # shares two blocks with an earlier prompt: a prefix hit
    params = SamplingParams(max_tokens=12, **GREEDY)
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
    llm = LLM(model=path, dtype="float32", device=cuda_family, num_blocks=64, max_num_batched_tokens=48,
              speculative_method=None)
    assert llm.engine.backend.line().startswith(f"backend: {cuda_family} dtype=float32 linear=cublas "
                                                "attention=triton-varlen+splitk")
    assert llm.engine.overlap  # the GPU's default: asynchronous scheduling
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert outs[-1].num_cached_tokens == 32
    assert_all_blocks_free(llm)


def test_split_k_decode_and_draft_verification_through_the_engine(tiny_checkpoint, cuda_family, tiny_llm,
                                                                   monkeypatch):
    """Decode-only steps over contexts past the split-K threshold (lowered here to 16
    tokens), and steps verifying drafts (several query rows after a request's cached
    tokens), give the torch path's tokens."""
    from sluice.backends.cuda import attention as ta
    from sluice.backends.cuda import backend as cb
    from tests.model.test_speculative import DraftsAlways
    monkeypatch.setattr(cb, "SPLIT_K_MIN_TOKENS", 16)
    split_steps = []
    real = ta.decode_attention
    monkeypatch.setattr(ta, "decode_attention", lambda *a, **k: split_steps.append(k.get("out")) or real(*a, **k))
    path = str(tiny_checkpoint("llama"))
    prompts = prompts_of_lengths(None, [70, 33], seed=4)
    params = SamplingParams(max_tokens=10, **GREEDY)
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
    plain = LLM(model=path, dtype="float32", device=cuda_family, num_blocks=64, speculative_method=None)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == want
    assert split_steps
    spec = LLM(model=path, dtype="float32", device=cuda_family, num_blocks=64, speculative_gate="always")
    spec.engine.scheduler.spec.proposer = DraftsAlways()
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.scheduler.spec.stats.drafted > 0
    assert_all_blocks_free(plain)
    assert_all_blocks_free(spec)


def test_grammar_and_penalties_on_the_gpu_path_with_async_scheduling(tiny_checkpoint, cuda_family, tiny_llm):
    """Structured outputs (the grammar's mask applied on the device) and penalties beside
    plain decodes, under asynchronous scheduling (their steps are collected before the next
    is planned, the others overlap): the torch path's tokens."""
    path = str(tiny_checkpoint("llama"))
    prompts = prompts_of_lengths(None, [11, 26, 40], seed=8)
    params = [SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": "[a-z]{2,9}[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.4, frequency_penalty=0.3),
              SamplingParams(max_tokens=12, **GREEDY)]
    want = [(o.outputs[0].token_ids, o.outputs[0].text) for o in tiny_llm.generate(prompts, params)]
    llm = LLM(model=path, dtype="float32", device=cuda_family, num_blocks=64, speculative_method=None)
    assert llm.engine.overlap
    assert [(o.outputs[0].token_ids, o.outputs[0].text) for o in llm.generate(prompts, params)] == want
    assert_all_blocks_free(llm)


def test_what_cuda_cannot_run_is_refused_in_one_line():
    from sluice.config import EngineConfig
    for kwargs, fragment in [(dict(quantization="w4a8"), "quantization='w4a8' runs on sluice's CPU kernels"),
                             (dict(kv_cache_dtype="int8"), "kv_cache_dtype='int8' runs on sluice's CPU kernels"),
                             (dict(deterministic=True), "deterministic mode runs on the CPU"),
                             (dict(tensor_parallel_size=2), "ranks over NCCL are not built yet")]:
        with pytest.raises(ValueError) as e:
            EngineConfig.from_kwargs(device="cuda", **kwargs)
        assert fragment in str(e.value) and "\n" not in str(e.value)
    if not GPU:
        with pytest.raises(ValueError, match="torch sees no CUDA device here"):
            LLM(device="cuda")


def test_sliding_windows_on_the_triton_path(tiny_checkpoint, monkeypatch):
    """Gemma 3's sliding-window layers (a window of 8, far shorter than the prompts) through
    the flat kernel and the split-K decode (threshold lowered to 16 tokens) give the CPU
    backend's torch-path greedy tokens. (A mixture of experts has nothing of its own on this
    path: its experts are Linear layers, cuBLAS's like any other.)"""
    from sluice.backends import select
    from sluice.backends.cuda import backend as cb
    path = str(tiny_checkpoint("gemma3"))
    prompts = prompts_of_lengths(None, [5, 17, 40, 33], seed=5)
    params = SamplingParams(max_tokens=8, **GREEDY)
    want = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32", num_blocks=64).generate(prompts, params)]
    monkeypatch.setattr(cb, "SPLIT_K_MIN_TOKENS", 16)
    if not GPU:  # the CUDA family on CPU tensors, under the interpreter
        monkeypatch.setitem(select.FAMILIES, "cpu", ("sluice.backends.cuda.backend", "CudaBackend"))
    llm = LLM(model=path, dtype="float32", device="cuda" if GPU else "cpu", num_blocks=64,
              max_num_batched_tokens=24, speculative_method=None)
    assert llm.engine.backend.family == "cuda"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert_all_blocks_free(llm)
