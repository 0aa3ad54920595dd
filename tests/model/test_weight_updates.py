"""Weight updates (issue 22): an engine whose weights were replaced computes exactly what a
fresh engine loaded from the new weights computes, in every linear method (float32,
bf16 kernels, int8, w8a8, torch's int8), for whole and partial updates; bad updates are
refused whole; requests in flight go on, recomputed on the new weights; sleep frees the
KV cache and wake_up restores it."""
from __future__ import annotations

import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from sluice import LLM, SamplingParams
from sluice.quantization.int8 import int8_weight, quantize_per_channel, quantize_rows
from sluice.engine.llm_engine import EngineAsleepError, EngineBusyError
from sluice.models.linear import Linear
from tests.conftest import assert_all_blocks_free

PROMPTS = [[1, 450, 6938, 310, 3444, 338], [1, 3139, 1303, 29892, 263, 931, 29892, 727], [1, 22172]]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)


def new_checkpoint(src, dst, seed: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """A copy of checkpoint folder `src` at `dst` with new weights (every tensor, or those
    in `names`); returns the new tensors that differ."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    changed = {}
    for name, t in sd.items():
        if names is None or name in names:
            sd[name] = changed[name] = (t + 0.2 * t.std() * torch.randn(t.shape, generator=g)).contiguous()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return changed


def outputs(llm: LLM, prompts=PROMPTS, params=GREEDY):
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


MODES = [
    pytest.param("llama", dict(dtype="float32"), None, id="float32-torch"),
    pytest.param("llama-4layers", dict(dtype="bfloat16"), None, id="bf16-kernels", marks=pytest.mark.requires("kernels")),
    pytest.param("llama-4layers", dict(dtype="bfloat16", quantization="int8"), None, id="int8-kernels",
                 marks=pytest.mark.requires("kernels")),
    pytest.param("llama-4layers", dict(dtype="bfloat16", quantization="w8a8"), None, id="w8a8",
                 marks=pytest.mark.requires("kernels")),
    pytest.param("qwen2", dict(dtype="bfloat16", quantization="w8a8"), ["model.embed_tokens.weight"],
                 id="w8a8-tied-head-embedding-only", marks=pytest.mark.requires("kernels")),
    pytest.param("qwen2", dict(dtype="bfloat16"), ["model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight"],
                 id="bf16-tied-head-embedding", marks=pytest.mark.requires("kernels")),
    pytest.param("llama-4layers", dict(dtype="bfloat16", quantization="int8", cpu_isa="generic"),
                 ["model.layers.1.self_attn.k_proj.weight", "model.layers.2.mlp.up_proj.weight", "lm_head.weight"],
                 id="int8-torch-partial"),
    pytest.param("llama-4layers", dict(dtype="bfloat16", quantization="w8a8"),
                 ["model.layers.1.self_attn.q_proj.weight", "model.layers.2.mlp.down_proj.weight",
                  "model.layers.0.input_layernorm.weight"], id="w8a8-partial", marks=pytest.mark.requires("kernels")),
    pytest.param("llama-4layers", dict(dtype="bfloat16", quantization="w4a8"),
                 ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
                  "model.layers.2.mlp.down_proj.weight", "model.layers.3.mlp.up_proj.weight"],
                 id="w4a8-partial", marks=pytest.mark.requires("kernels")),
    # Layers that released their weight once packed take new rows through write_rows: two
    # parts of one fused layer in one update, and the last layer (w4a8: an end layer).
    pytest.param("llama-4layers", dict(dtype="bfloat16"),
                 ["model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.v_proj.weight",
                  "model.layers.3.mlp.gate_proj.weight"],
                 id="bf16-kernels-partial", marks=pytest.mark.requires("kernels")),
]


@pytest.mark.parametrize("kind,opts,names", MODES)
def test_updated_engine_computes_what_a_fresh_load_of_the_new_weights_does(tiny_checkpoint, tmp_path, kind, opts,
                                                                         names):
    src = tiny_checkpoint(kind)
    new = new_checkpoint(src, tmp_path / "new", seed=1, names=names)
    llm = LLM(model=str(src), num_blocks=64, **opts)
    before = outputs(llm)
    assert llm.update_weights(new) == len(new)
    assert llm.weight_version == "1"
    fresh = LLM(model=str(tmp_path / "new"), num_blocks=64, **opts)
    after = outputs(llm)
    assert after == outputs(fresh)  # tokens and logprobs, bit for bit
    assert after != before
    assert_all_blocks_free(llm)


@pytest.mark.requires("kernels")
@pytest.mark.parametrize("kind", ["llama-4layers", "qwen2"])
@pytest.mark.parametrize("opts", [dict(dtype="bfloat16"), dict(dtype="bfloat16", quantization="w4a8")],
                         ids=["bf16", "w4a8"])
def test_layers_on_the_kernels_keep_only_what_they_multiply_by(tiny_checkpoint, kind, opts):
    """Once packed, a linear layer on the kernels keeps no bf16 weight beside its packed
    form (2 bytes a parameter, an 8B model's 16 GB); an untied LM head keeps its own, which
    the greedy head's int8 copy and the logits' fallback are made from; a tied head's
    embedding table reads its rows from the head's packed copy (qwen2: tied)."""
    llm = LLM(model=str(tiny_checkpoint(kind)), num_blocks=64, **opts)
    model = llm.engine.runner.model
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert all(m.weight.device.type == "meta" for n, m in linears.items() if n != "lm_head")
    tied = model.lm_head is None
    assert tied == (kind == "qwen2")
    assert model.model.embed_tokens.weight.device.type == ("meta" if tied else "cpu")
    if not tied:
        assert linears["lm_head"].weight.device.type == "cpu"
    ids = torch.tensor([[0, 1, 17], [model.arch.vocab_size - 1, 5, 16]])
    table = {}
    for f in sorted(tiny_checkpoint(kind).glob("*.safetensors")):
        table.update(load_file(f))
    assert torch.equal(model.model.embed_tokens(ids), table["model.embed_tokens.weight"].to(torch.bfloat16)[ids])


@pytest.mark.requires("kernels")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_packed_weight_unpacks_to_itself(dtype):
    """What a released layer's new rows are written into: its packed copy, unpacked; and a
    tied embedding's rows, read from the head's packed copy (bf16)."""
    from sluice.backends.cpu import x86 as kernels
    from sluice.backends.cpu.linear import unpack_weight
    k = kernels.load()
    w = torch.randn(37, 131).to(dtype)
    packed = k.bi_pack_weight(w)
    assert torch.equal(unpack_weight(packed, 37, 131), w)
    if dtype == torch.bfloat16:
        ids = torch.tensor([36, 0, 17, 16, 15, 36])
        assert torch.equal(k.bi_packed_rows(ids, packed, 37, 131), w[ids])
        for bad in (37, 47, -1):  # past the table (37, 47: in the packing's padding)
            with pytest.raises(RuntimeError, match="row out of range"):
                k.bi_packed_rows(torch.tensor([bad]), packed, 37, 131)


@pytest.mark.requires("kernels")
@pytest.mark.parametrize("nibbles_only", [False, True])
def test_packed_4bit_weights_unpack_to_their_form(nibbles_only):
    """What a w4a8 layer's update is written into once its FourBit is dropped: the q, d and
    m its packed copy holds, from the byte layout (kept on the AVX2 builds for bigger
    steps) or from the nibbles alone, with float32 or float16 scales."""
    from sluice.backends.cpu import x86 as kernels
    from sluice.backends.cpu.linear import kernel_weight
    from sluice.quantization.w4a8 import quantize_4bit, unpack_4bit
    k = kernels.load()
    torch.manual_seed(3)
    n, kk = 37, 131
    q, d, m = quantize_4bit(torch.randn(n, kk).to(torch.bfloat16))
    for d_, m_ in ((d, m), (d.half().float(), m.half().float())):  # float32 scales; float16 values (a GGUF's)
        method = kernel_weight(k, torch.empty(n, kk, device="meta"), None, False, w4=(q, d_, m_),
                               nibbles_only=nibbles_only)
        back = unpack_4bit(method, n, kk).unpacked()
        assert all(torch.equal(a, b) for a, b in zip(back, (q, d_, m_)))


def test_int8_quantization_by_chunks_is_the_one_pass_values(monkeypatch):
    """quantize_per_channel goes a chunk of rows at a time through one float32 buffer (a
    whole table's temporaries took 2 GB for Gemma 3's): the same int8 values and scales as
    one pass over the whole weight, zero rows and a last short chunk included."""
    import sluice.quantization.int8 as int8
    monkeypatch.setattr(int8, "CHUNK_VALUES", 7 * 96)  # 7 rows a chunk: 300 rows in 43 chunks
    torch.manual_seed(5)
    w = (torch.randn(300, 96) * torch.logspace(-3, 1, 300)[:, None]).to(torch.bfloat16)
    w[11] = 0
    q, scale = quantize_per_channel(w)
    x = w.float()
    want_scale = (x.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q, torch.round(x / want_scale[:, None]).clamp(-127, 127).to(torch.int8))


def test_int8_weights_read_back_exactly():
    """Quantized layers keep only their dequantized bf16 weights and float32 scales; the
    int8 values read back from them are the ones quantizing computed (what lets an update
    rebuild a fused layer's untouched rows exactly)."""
    torch.manual_seed(0)
    layer = Linear(512, 300, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(torch.logspace(-4, 2, 300)[:, None].to(torch.bfloat16))  # scales over six decades
        layer.weight[:, 0] = 0
        layer.weight[7] = 0  # a zero row
    q, scale = quantize_per_channel(layer.weight)
    quantize_rows(layer)
    q_back, scale_back = int8_weight(layer, torch.float32)
    assert torch.equal(q_back, q)
    assert torch.equal(scale_back, scale)


def test_bad_updates_are_refused_whole(tiny_llm):
    before = outputs(tiny_llm)
    version = tiny_llm.weight_version
    good = tiny_llm.engine.shard.model.model.norm.weight.detach().clone() + 1
    bad = {
        "model.layers.9.mlp.up_proj.weight": (torch.zeros(128, 64), "no place in this model"),
        "model.layers.0.mlp.up_proj.weight": (torch.zeros(64, 128), "has shape [64, 128], this model's is [128, 64]"),
        "model.layers.0.self_attn.o_proj.weight": (torch.zeros(64, 64, dtype=torch.int32), "floating-point dtype"),
        "model.layers.1.input_layernorm.weight": ([0.0] * 64, "must be a torch.Tensor"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            tiny_llm.update_weights({"model.norm.weight": good, name: value})
        assert name in str(e.value)
    with pytest.raises(ValueError, match="given twice"):
        tiny_llm.update_weights([("model.norm.weight", good), ("model.norm.weight", good)])
    with pytest.raises(ValueError, match="at least one tensor"):
        tiny_llm.update_weights({})
    with pytest.raises(ValueError, match="weight_version"):
        tiny_llm.update_weights({"model.norm.weight": good}, weight_version="")
    with pytest.raises(ValueError, match="safetensors"):
        tiny_llm.load_weights("/nonexistent/weights.bin")
    assert outputs(tiny_llm) == before  # nothing changed
    assert tiny_llm.weight_version == version


def test_requests_in_flight_continue_on_the_new_weights(tiny_checkpoint, tmp_path):
    """An update between steps preempts the running requests; they finish, and what they
    generate after it is the new model's greedy continuation of what they had."""
    src = tiny_checkpoint("llama")
    new = new_checkpoint(src, tmp_path / "new", seed=2)
    llm = LLM(model=str(src), dtype="float32", num_blocks=64)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, params)
    for _ in range(5):
        engine.step()
    had = {rid: list(r.output_token_ids) for rid, r in engine.scheduler.requests.items()}
    assert all(had.values())
    engine.update_weights(new, weight_version="step-1")
    assert engine.weight_version == "step-1"
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert_all_blocks_free(llm)
    fresh = LLM(model=str(tmp_path / "new"), dtype="float32", num_blocks=64)
    for i, p in enumerate(PROMPTS):
        rid = f"r{i}"
        tokens = done[rid]
        assert len(tokens) == 16 and tokens[:len(had[rid])] == had[rid]
        rest = fresh.generate(p + had[rid], SamplingParams(temperature=0, max_tokens=16 - len(had[rid]),
                                                            ignore_eos=True), use_tqdm=False)[0]
        assert tokens[len(had[rid]):] == rest.outputs[0].token_ids


def test_load_weights_from_a_file_or_folder(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("llama")
    new_checkpoint(src, tmp_path / "new", seed=3)
    fresh = outputs(LLM(model=str(tmp_path / "new"), dtype="float32", num_blocks=64))
    llm = LLM(model=str(src), dtype="float32", num_blocks=64)
    assert llm.load_weights(str(tmp_path / "new" / "model.safetensors"), weight_version="v2") > 0
    assert llm.weight_version == "v2" and outputs(llm) == fresh
    llm.load_weights(str(src))  # the folder: back to the original
    assert llm.weight_version == "2"
    assert outputs(llm) == outputs(LLM(model=str(src), dtype="float32", num_blocks=64))


def test_sleep_frees_the_kv_cache_and_wake_up_restores_it(tiny_llm):
    before = outputs(tiny_llm)
    engine = tiny_llm.engine
    engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(EngineBusyError, match="in flight"):
        tiny_llm.sleep()
    engine.abort("busy")
    runner = engine.runner
    k = runner.kv_caches[0][0]
    freed = tiny_llm.sleep()
    assert freed == 2 * runner.arch.num_layers * k.numel() * k.element_size()
    assert runner.kv_caches is None and engine.asleep
    assert tiny_llm.sleep() == 0  # already asleep
    with pytest.raises(EngineAsleepError, match="wake_up"):
        tiny_llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    tiny_llm.wake_up()
    assert outputs(tiny_llm) == before
    assert_all_blocks_free(tiny_llm)
