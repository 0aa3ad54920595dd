"""Shared fixtures: tiny random checkpoints written by transformers, and the default model."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

from sluice.models.loader import resolve_model

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# What a test may need from this machine, checked in one place: mark it
# `@pytest.mark.requires("avx512_vnni")` and it skips, saying why, where that is missing.
# (`make test-avx2` runs the suite as on an AVX2-only CPU: see backends/platform.py.)
FEATURES = {
    "kernels": "our C++ kernels",
    "avx512f": "our AVX-512 kernels (argmax, the vector attention paths)",
    "avx512_bf16": "our AVX-512 BF16 kernels (bf16 linear layers, deterministic mode)",
    "avx512_vnni": "our AVX-512 VNNI kernels (w8a8, the int8 KV cache, the greedy LM head)",
}


def missing_feature(feature: str) -> str | None:
    """Why `feature` is unavailable here, or None when it is available."""
    from sluice.backends.platform import cpu
    from sluice.worker import kernels
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r} in a requires marker; known: {', '.join(FEATURES)}")
    info = cpu()
    if feature != "kernels" and feature not in info.flags:
        return f"needs {FEATURES[feature]}: {info.describe()} lacks {feature}"
    mod = kernels.load()
    if mod is None:
        return f"needs {FEATURES[feature]}, but the C++ kernels did not build here (see the log)"
    built = {"kernels": True, "avx512f": True, "avx512_bf16": getattr(mod, "has_batch_invariant", False),
             "avx512_vnni": getattr(mod, "has_w8a8", False)}
    return None if built[feature] else f"needs {FEATURES[feature]}, which this kernel build lacks"


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*features): skip unless this machine has them "
                                       f"({', '.join(FEATURES)}); the reason says what is missing")


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in item.iter_markers("requires"):
            reasons = [r for r in map(missing_feature, mark.args) if r]
            if reasons:
                item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


@pytest.fixture(scope="session")
def smollm2_source():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_tokenizer(smollm2_source):
    """SmolLM2's tokenizer (built by transformers from the GGUF); tiny checkpoints reuse it."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(smollm2_source.folder), gguf_file=smollm2_source.path.name)


TINY_COMMON = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, initializer_range=0.2)


def make_tiny_config(kind: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    if kind == "llama":
        return LlamaConfig(**TINY_COMMON, tie_word_embeddings=False)
    if kind == "llama-4layers":  # with middle layers, which w8a8 quantizes (not the first or last)
        return LlamaConfig(**{**TINY_COMMON, "num_hidden_layers": 4}, tie_word_embeddings=False)
    if kind == "llama3-rope":
        return LlamaConfig(**TINY_COMMON, tie_word_embeddings=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64}, rope_theta=500000.0)
    if kind == "qwen2":
        return Qwen2Config(**TINY_COMMON, tie_word_embeddings=True)
    if kind == "qwen3":
        return Qwen3Config(**TINY_COMMON, head_dim=32, tie_word_embeddings=True)
    raise ValueError(kind)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, hf_tokenizer):
    """Factory: kind -> folder with config.json, model.safetensors and tokenizer files."""
    cache = {}

    def make(kind: str):
        if kind not in cache:
            from transformers import AutoModelForCausalLM
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(make_tiny_config(kind), torch_dtype=torch.float32)
            # Bias terms start at zero; give them values so that loading them is really tested.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias") or "norm" in name:
                        p.add_(torch.randn_like(p) * 0.1)
            path = tmp_path_factory.mktemp(kind)
            model.save_pretrained(path)
            hf_tokenizer.save_pretrained(path)
            cache[kind] = path
        return cache[kind]

    return make


@pytest.fixture(scope="session")
def tiny_llm(tiny_checkpoint):
    from sluice import LLM
    return LLM(model=str(tiny_checkpoint("llama")), dtype="float32", num_blocks=256)


@pytest.fixture(scope="session")
def smollm2_llm():
    from sluice import LLM
    return LLM(dtype="float32", kv_cache_memory=0.25)


def assert_all_blocks_free(llm) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks, f"{kv.num_blocks - kv.num_free_blocks} KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()
