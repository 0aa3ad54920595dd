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


def steps(n: int) -> int:
    """n output tokens on a GPU, half of them under Triton's interpreter (which runs each
    kernel program by program in Python: a decode step of a few sequences takes ~0.3 s)."""
    return n if GPU else n // 2


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
    params = SamplingParams(max_tokens=steps(12), **GREEDY)
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
    # Contexts up to 47 tokens (42 under the interpreter): three splits of 16, the shorter
    # sequence's last one empty.
    prompts = prompts_of_lengths(None, [38, 19], seed=4)
    params = SamplingParams(max_tokens=steps(10), **GREEDY)
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
    params = [SamplingParams(temperature=0, max_tokens=steps(12), structured_outputs={"regex": "[a-z]{2,9}[0-9]{1,3}"}),
              SamplingParams(temperature=0, max_tokens=steps(12), repetition_penalty=1.4, frequency_penalty=0.3),
              SamplingParams(max_tokens=steps(12), **GREEDY)]
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
    params = SamplingParams(max_tokens=steps(8), **GREEDY)
    want = [o.outputs[0].token_ids for o in LLM(model=path, dtype="float32", num_blocks=64).generate(prompts, params)]
    monkeypatch.setattr(cb, "SPLIT_K_MIN_TOKENS", 16)
    if not GPU:  # the CUDA family on CPU tensors, under the interpreter
        monkeypatch.setitem(select.FAMILIES, "cpu", ("sluice.backends.cuda.backend", "CudaBackend"))
    llm = LLM(model=path, dtype="float32", device="cuda" if GPU else "cpu", num_blocks=64,
              max_num_batched_tokens=24, speculative_method=None)
    assert llm.engine.backend.family == "cuda"
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert_all_blocks_free(llm)


def fp8_checkpoint(src, dst, per_tensor: bool):
    """A copy of a checkpoint whose decoder linear weights are e4m3: as an FP8 checkpoint
    carries them (weight in float8_e4m3fn plus weight_scale, one per tensor or per output
    channel; per_tensor=None: stored dequantized, q * scale, in float32 instead)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from sluice.backends.cuda.fp8 import quantize_rows_reference
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if ".layers." not in name or not name.endswith("proj.weight"):
            out[name] = t
            continue
        if per_tensor:
            s = (t.abs().max() / 448.0).reshape(())
            q = (t / s).clamp(-448, 448).to(torch.float8_e4m3fn)
        else:
            q, s = quantize_rows_reference(t)
        if per_tensor is None:
            out[name] = q.float() * s.reshape(-1, 1)
        else:
            out[name], out[name.removesuffix("weight") + "weight_scale"] = q, s
    save_file(out, str(dst / "model.safetensors"))
    if per_tensor is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_fp8_weights_compute_their_dequantized_values(tiny_checkpoint, cuda_family, tmp_path):
    """--quantization fp8: every decoder linear layer keeps only e4m3 weights and a scale
    per output channel (the bf16 weight released), and in float32 computes exactly with
    those values (the GEMV widens them): the torch path's greedy tokens on a checkpoint
    holding the same values. A weight update quantizes its new rows the same way."""
    from sluice.backends.cuda.fp8 import quantize_rows_reference
    src = tiny_checkpoint("llama")
    deq = fp8_checkpoint(src, tmp_path / "deq", per_tensor=None)
    prompts = prompts_of_lengths(None, [5, 23, 40], seed=9)
    params = SamplingParams(max_tokens=steps(8), **GREEDY)
    want = [o.outputs[0].token_ids for o in LLM(model=str(deq), dtype="float32", num_blocks=64).generate(prompts,
                                                                                                        params)]
    llm = LLM(model=str(src), dtype="float32", device=cuda_family, num_blocks=64, quantization="fp8",
              speculative_method=None)
    assert " linear=fp8(scaled_mm+gemv) " in llm.engine.backend.line()
    layer = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert layer.weight.device.type == "meta" and layer.fp8_weight.dtype == torch.float8_e4m3fn
    assert llm.engine.runner.model.lm_head.weight.dtype == torch.float32     # the head keeps the model's dtype
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    new = torch.randn(32, 64)
    llm.update_weights({"model.layers.0.self_attn.k_proj.weight": new})
    q, s = quantize_rows_reference(new)
    k_rows = slice(64, 96)  # q_proj's 64 rows, then k_proj's 32 (two KV heads of 16)
    assert torch.equal(layer.fp8_weight[k_rows].cpu().float(), q.float())
    assert torch.equal(layer.fp8_scale[k_rows].cpu(), s)
    assert llm.generate(prompts[:1], params)[0].outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_an_fp8_checkpoint_loads_as_it_is(tiny_checkpoint, cuda_family, tmp_path):
    """A checkpoint with quant_method "fp8" (e4m3 weights, a scale per tensor): on the CUDA
    backend quantization='auto' runs it as FP8 with the file's own values (nothing
    rounded twice: each part of a fused layer keeps its tensor's scale); on the CPU it loads
    dequantized. Both give the same greedy tokens in float32."""
    from safetensors.torch import load_file
    path = fp8_checkpoint(tiny_checkpoint("llama"), tmp_path / "fp8", per_tensor=True)
    stored = load_file(str(path / "model.safetensors"))
    prompts = prompts_of_lengths(None, [7, 30], seed=10)
    params = SamplingParams(max_tokens=steps(8), **GREEDY)
    cpu = LLM(model=str(path), dtype="float32", num_blocks=64)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params)]
    llm = LLM(model=str(path), dtype="float32", device=cuda_family, num_blocks=64, speculative_method=None)
    assert llm.engine.config.model.quantization == "fp8"
    layer = llm.engine.runner.model.model.layers[1].mlp.gate_up_proj
    gate, up = "model.layers.1.mlp.gate_proj.", "model.layers.1.mlp.up_proj."
    assert torch.equal(layer.fp8_weight.cpu().float(),
                       torch.cat([stored[gate + "weight"], stored[up + "weight"]]).float())
    assert torch.equal(layer.fp8_scale.cpu(), torch.cat([stored[gate + "weight_scale"].expand(128),
                                                         stored[up + "weight_scale"].expand(128)]))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_fp8_kv_cache_keeps_tokens_through_chunking_and_preemption(tiny_checkpoint, cuda_family, tiny_llm):
    """kv_cache_dtype='fp8': e4m3 K and V with a scale per token and head, 1 + 4/D bytes a
    value. A token's attention does not depend on how its prompt was chunked or whether
    its request was preempted and recomputed; the tokens mostly agree with a full cache."""
    path = str(tiny_checkpoint("llama"))
    # Short (Triton's interpreter runs a kernel program by program in Python), yet chunked
    # at 16 tokens, and on 5 blocks of 16 the prompts' 1 + 2 + 2 blocks fit but their
    # decodes need a sixth: preemption by recompute.
    prompts = prompts_of_lengths(None, [5, 28, 30], seed=15)
    params = SamplingParams(max_tokens=8, **GREEDY)
    common = dict(model=path, dtype="float32", device=cuda_family, speculative_method=None)
    ref = LLM(**common, num_blocks=64, kv_cache_dtype="fp8")
    assert ref.engine.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert " kv=fp8 " in ref.engine.backend.line()
    arch = ref.engine.runner.model.arch
    assert ref.engine.backend.kv_row_bytes(arch) == arch.head_dim + 4
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    chunked = LLM(**common, num_blocks=64, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in chunked.generate(prompts, params)] == want
    small = LLM(**common, num_blocks=5, kv_cache_dtype="fp8", max_num_batched_tokens=32)
    assert [o.outputs[0].token_ids for o in small.generate(prompts, params)] == want
    assert small.engine.scheduler.num_preemptions > 0
    # A full cache's tokens: the torch path's (the Triton path's own, test above).
    full = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]

    def agreeing(a, b):  # leading tokens in common
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    # Measured on the tiny random model (near-ties everywhere): 7, 0 and 5 tokens of 8 (and
    # over seeds 11-18 a total of 2 to 12 of 24, the middle prompt's first token often a tie).
    agree = [agreeing(a, b) for a, b in zip(want, full)]
    assert sum(agree) >= 8 and sum(a >= 1 for a in agree) >= 2, agree
    for llm in (ref, chunked, small):
        assert_all_blocks_free(llm)


def test_fp8_modes_are_refused_where_they_cannot_run():
    from sluice.config import EngineConfig
    for kwargs, fragment in [(dict(quantization="fp8"), "quantization='fp8' runs on CUDA"),
                             (dict(kv_cache_dtype="fp8"), "kv_cache_dtype='fp8' runs on CUDA")]:
        with pytest.raises(ValueError) as e:
            EngineConfig.from_kwargs(device="cpu", **kwargs)
        assert fragment in str(e.value) and "what works" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="what works: quantization='fp8' or None"):
        EngineConfig.from_kwargs(device="cuda", quantization="w8a8")


def test_an_fp8_cache_is_offloaded_as_it_is(tiny_checkpoint, cuda_family):
    """The FP8 cache's blocks (scales and e4m3 rows) go to the host tier as bytes and come
    back bit-exact; 'int8' offloading is refused for it."""
    from tests.model.test_kv_offload import assert_offloaded_as_it_is
    assert_offloaded_as_it_is(small=not GPU, model=str(tiny_checkpoint("llama")), dtype="float32",
                              device=cuda_family, kv_cache_dtype="fp8", speculative_method=None)
