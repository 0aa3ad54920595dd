"""Mixture-of-experts GGUFs (llama.cpp's layout: every expert of a layer in one 3-D tensor,
ffn_{gate,up,down}_exps, and the router ffn_gate_inp), qwen3moe files and Mixtral's (a
`llama` file with experts, Q and K permuted as llama.cpp's converter does): written here
from tiny random checkpoints with the default model's tokenizer, loaded as llama.cpp's
files are."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize

from sluice import LLM, SamplingParams
from tests.conftest import TINY_COMMON

# HF names -> llama.cpp's, for the non-expert tensors.
NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}


@functools.lru_cache(maxsize=1)
def tokenizer_fields(path: str) -> list[tuple]:
    """A GGUF's tokenizer metadata (the vocabulary, merges, special ids), read once for
    every file written here (gguf's reader takes seconds over a 49,152-token vocabulary)."""
    out = []
    for field in GGUFReader(path).fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            out.append((field.name, field.contents(), vtype, field.types[-1] if vtype.name == "ARRAY" else None))
    return out


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's permute() of Q and K rows for `llama` files (rotate-half
    pairs to interleaved ones): what our loader undoes."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(state: dict, config, path, tokenizer_from, experts_type: GGMLQuantizationType,
                        arch: str = "qwen3moe"):
    """state: the checkpoint's tensors as saved (one tensor per expert and projection).
    arch "llama": Mixtral's layout (block_sparse_moe names in, Q and K permuted, an untied
    output matrix)."""
    mixtral = arch == "llama"
    experts = config.num_local_experts if mixtral else config.num_experts
    if mixtral:  # Mixtral's checkpoint names -> Qwen3-MoE's, which the writer below reads
        renames = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                   (".w2.", ".down_proj."))
        out = {}
        for name, t in state.items():
            for a, b in renames:
                name = name.replace(a, b)
            out[name] = t
        state = out
    w = GGUFWriter(str(path), arch)
    w.add_context_length(config.max_position_embeddings)
    w.add_block_count(config.num_hidden_layers)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    if not mixtral:
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if mixtral:
        w.add_rope_dimension_count(head_dim)
    else:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_expert_count(experts)
    w.add_expert_used_count(config.num_experts_per_tok)
    w.add_file_type(GGMLQuantizationType.F32)
    for name, value, vtype, sub in tokenizer_fields(str(tokenizer_from)):
        w.add_key_value(name, value, vtype, sub_type=sub)
    for name, t in state.items():
        if ".experts." in name:
            continue
        if name == "lm_head.weight":
            if mixtral:
                w.add_tensor("output.weight", t.float().numpy())
            continue
        kind = None
        if name in NAMES:
            gname = NAMES[name]
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            kind, _, suffix = rest.rpartition(".")
            gname = f"blk.{layer}.{LAYER[kind]}.{suffix}"
        a = t.float().numpy()
        if mixtral and kind in ("self_attn.q_proj", "self_attn.k_proj"):
            a = llama_cpp_permute(a, config.num_attention_heads if kind == "self_attn.q_proj"
                                  else config.num_key_value_heads)
        w.add_tensor(gname, a)
    for i in range(config.num_hidden_layers):
        for proj in ("gate", "up", "down"):
            stacked = np.stack([state[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"].float().numpy()
                                for e in range(experts)])
            if experts_type == GGMLQuantizationType.F32:
                w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", stacked)
            else:
                w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", quantize(stacked, experts_type),
                             raw_dtype=experts_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def save_tiny_checkpoint(config, folder, seed: int, tokenizer) -> dict:
    """A random model of `config` (norms moved off 1, so that loading them is tested) saved
    with the tokenizer into folder; returns its tensors as saved."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory, hf_tokenizer, smollm2_source):
    from transformers import Qwen3MoeConfig
    config = Qwen3MoeConfig(**{**TINY_COMMON, "num_hidden_layers": 2}, head_dim=32, tie_word_embeddings=True,
                            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    root = tmp_path_factory.mktemp("moe-gguf")
    state = save_tiny_checkpoint(config, root / "hf", 0, hf_tokenizer)
    files = {}
    for t in (GGMLQuantizationType.F32, GGMLQuantizationType.Q8_0):
        (root / t.name).mkdir()
        files[t.name] = root / t.name / "tiny-moe.gguf"
        write_moe_gguf(state, config, files[t.name], smollm2_source.path, t)
    return root / "hf", files


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [500, 9000, 77, 42], [12345] * 5]


def test_moe_gguf_loads_like_its_checkpoint(moe_files):
    """float32: the GGUF's experts, router and config (its expert width included) give the
    Hugging Face checkpoint's tokens, bit for bit."""
    hf, files = moe_files
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model=str(hf), dtype="float32", num_blocks=64).generate(PROMPTS, params)]
    llm = LLM(model=str(files["F32"]), dtype="float32", num_blocks=64)
    assert llm.engine.runner.model.arch.moe_intermediate_size == 32
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want


@pytest.mark.requires("kernels")
def test_moe_gguf_experts_run_in_their_q8_0_blocks(moe_files, best_kernel_isa):
    hf, files = moe_files
    # (Its attention matrices are float32, so the automatic choice is full precision: asked.)
    llm = LLM(model=str(files["Q8_0"]), cpu_isa=best_kernel_isa, quantization="gguf", num_blocks=64)
    assert "linear=kernels-gguf" in llm.engine.runner.backend.line()
    expert = llm.engine.runner.model.model.layers[1].mlp.experts[3]
    assert expert.down_proj.method.w4a8.dtype == torch.int8 and expert.down_proj.weight.device.type == "meta"
    # Expert 3's blocks hold its slice of the file's 3-D tensor, exactly as ggml dequantizes it.
    from gguf.quants import dequantize
    from safetensors.torch import load_file
    down = load_file(str(hf / "model.safetensors"))["model.layers.1.mlp.experts.3.down_proj.weight"].numpy()
    want = dequantize(quantize(down, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    m = expert.down_proj.method
    rows = m.kernels.w4a8_rows(torch.arange(down.shape[0]), m.w4a8, m.w4d, m.w4m, down.shape[1])
    assert torch.equal(rows, torch.from_numpy(want))
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)


def test_mixtral_gguf_loads_like_its_checkpoint(tmp_path, hf_tokenizer, smollm2_source):
    """A Mixtral file as llama.cpp writes it (architecture `llama` with expert_count, Q and
    K permuted, experts stacked): read as Mixtral, float32 tokens equal the Hugging Face
    checkpoint's, bit for bit."""
    from transformers import MixtralConfig
    config = MixtralConfig(**{**TINY_COMMON, "num_hidden_layers": 2, "intermediate_size": 48}, num_local_experts=4,
                           num_experts_per_tok=2, tie_word_embeddings=False)
    state = save_tiny_checkpoint(config, tmp_path / "hf", 1, hf_tokenizer)
    path = tmp_path / "tiny-mixtral.gguf"
    write_moe_gguf(state, config, path, smollm2_source.path, GGMLQuantizationType.F32, arch="llama")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    hf = LLM(model=str(tmp_path / "hf"), dtype="float32", num_blocks=64)
    want = [o.outputs[0].token_ids for o in hf.generate(PROMPTS, params)]
    llm = LLM(model=str(path), dtype="float32", num_blocks=64)
    arch = llm.engine.runner.model.arch
    assert (arch.num_experts, arch.num_experts_per_tok, arch.moe_intermediate_size) == (4, 2, 48)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == want
