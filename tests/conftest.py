"""Shared fixtures: tiny random checkpoints written by transformers, and the default model."""
from __future__ import annotations

import os
import struct

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

# Without a GPU the CUDA backend's Triton kernels run under Triton's interpreter on CPU
# tensors: set before anything imports triton (its kernels read it when they are defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sluice.models.loader import resolve_model

# One thread per process where pytest-xdist runs workers side by side (`make test` runs one
# per core): two workers' kernel teams spinning on two cores would wait on each other's
# time slices. The tests of the kernels' splits over threads set two threads themselves.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(autouse=True, scope="session")
def cpu_unless_named():
    """device='auto' (the default) means cpu in the suite even on a machine with a GPU:
    the tests of the CUDA backend name their device, every other test is about the CPU's."""
    from sluice.backends import select
    saved, select.auto_device = select.auto_device, lambda: "cpu"
    yield
    select.auto_device = saved

# What a test may need from this machine, checked in one place: mark it
# `@pytest.mark.requires("kernels")` and it skips, saying why, where that is missing.
FEATURES = {
    "kernels": "sluice's C++ kernels (an AVX2 or AVX-512 CPU and a compiler)",
}

# Every build of the kernels this CPU executes ("avx512", "avx512_vnni" and "avx2" on a
# Zen 4, "avx512_vnni" and "avx2" on an Ice Lake, "avx2" on a Zen 3).
from sluice.backends.platform import cpu  # noqa: E402

ALL_KERNEL_ISAS = [isa for isa in cpu().isas if isa != "generic"]
# The builds below the best where that is an AVX-512 one: tests/*/test_isa_builds* compare
# each with it, bit for bit.
LOWER_ISAS = ALL_KERNEL_ISAS[1:] if ALL_KERNEL_ISAS[:1] in (["avx512"], ["avx512_vnni"]) else []
# Tests that take the `kernel_isa` or `isa_kernels` fixture run once per build, but for
# avx512_vnni beside avx512: its code differs from that build's only in BF16's three
# instructions, which test_isa_builds checks; running every kernel test a third time on a
# Zen 4 would add minutes, not checks.
KERNEL_ISAS = [isa for isa in ALL_KERNEL_ISAS if not (isa == "avx512_vnni" and "avx512" in ALL_KERNEL_ISAS)]


def missing_feature(feature: str) -> str | None:
    """Why `feature` is unavailable here, or None when it is available."""
    from sluice.backends.cpu import x86 as kernels
    if feature not in FEATURES:
        raise ValueError(f"unknown feature {feature!r} in a requires marker; known: {', '.join(FEATURES)}")
    if not KERNEL_ISAS:
        return f"needs {FEATURES[feature]}: {cpu().describe()} has no AVX2"
    if kernels.load() is None:
        return f"needs {FEATURES[feature]}, but they did not build here (see the log)"
    return None


@pytest.fixture(scope="session", params=KERNEL_ISAS or [
    pytest.param(None, marks=pytest.mark.skip(reason=f"{cpu().describe()} runs no build of the kernels"))])
def kernel_isa(request) -> str:
    """Each kernel build this CPU executes, in turn."""
    from sluice.backends.cpu import x86 as kernels
    if kernels.load(request.param) is None:
        pytest.skip(f"the {request.param} kernels did not build here (see the log)")
    return request.param


@pytest.fixture(scope="session", params=KERNEL_ISAS[:1] or [
    pytest.param(None, marks=pytest.mark.skip(reason=f"{cpu().describe()} runs no build of the kernels"))])
def best_kernel_isa(request) -> str:
    """The best kernel build this CPU executes, for the tests on the default model: on a
    machine that runs both builds, tests/*/test_isa_builds*.py prove the AVX2 build gives
    the AVX-512 build's bits, so running those again on it would add minutes, not checks."""
    from sluice.backends.cpu import x86 as kernels
    if kernels.load(request.param) is None:
        pytest.skip(f"the {request.param} kernels did not build here (see the log)")
    return request.param


@pytest.fixture(scope="session")
def isa_kernels(kernel_isa):
    """The kernel module of each build this CPU executes, in turn."""
    from sluice.backends.cpu import x86 as kernels
    return kernels.load(kernel_isa)


def pytest_addoption(parser):
    parser.addoption("--kernel-isa", choices=KERNEL_ISAS or None, default=None,
                     help="run the per-build kernel tests for this build only (default: every build this CPU runs)")
    parser.addoption("--tokenizer-dir", default=None,
                     help="a folder with SmolLM2's tokenizer files, for the tiny checkpoints where the default "
                          "model's package is not installed (the GPU check's machine)")


def pytest_configure(config):
    config.addinivalue_line("markers", "requires(*features): skip unless this machine has them "
                                       f"({', '.join(FEATURES)}); the reason says what is missing")


def pytest_collection_modifyitems(config, items):
    only = config.getoption("--kernel-isa")
    if only:
        keep = [i for i in items if getattr(i, "callspec", None) is None
                or i.callspec.params.get("kernel_isa", only) == only
                and i.callspec.params.get("best_kernel_isa", only) == only]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    for item in items:
        for mark in item.iter_markers("requires"):
            reasons = [r for r in map(missing_feature, mark.args) if r]
            if reasons:
                item.add_marker(pytest.mark.skip(reason="; ".join(reasons)))


@pytest.fixture(scope="session")
def smollm2_source():
    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def hf_tokenizer(request):
    """SmolLM2's tokenizer (built by transformers from the GGUF, or read from
    --tokenizer-dir); tiny checkpoints reuse it."""
    from transformers import AutoTokenizer
    folder = request.config.getoption("--tokenizer-dir")
    if folder:
        return AutoTokenizer.from_pretrained(folder)
    source = request.getfixturevalue("smollm2_source")
    # The engine's own cached conversion (~13 s to make, once, then under a second), as
    # sluice.tokenizer loads it; from the GGUF itself only where that cache cannot be written.
    from sluice.models.loader import gguf_converted
    converted = gguf_converted(source)
    if converted is not None:
        return AutoTokenizer.from_pretrained(str(converted))
    return AutoTokenizer.from_pretrained(str(source.folder), gguf_file=source.path.name)


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
    if kind == "mistral":  # every layer a sliding window of 8 keys, shorter than the test prompts
        from transformers import MistralConfig
        return MistralConfig(**TINY_COMMON, sliding_window=8, tie_word_embeddings=False)
    if kind == "qwen2-yarn":  # YaRN: 8x past a 64-token original context, so the ramp and the temperature matter
        return Qwen2Config(**TINY_COMMON, tie_word_embeddings=True, rope_parameters={
            "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0})
    # Three layers, so that a sparse one sits in the middle (the layers w8a8 and w4a8 quantize).
    if kind == "qwen3-moe":  # 8 experts, top 2 renormalised; layer 2 dense (mlp_only_layers)
        from transformers import Qwen3MoeConfig
        return Qwen3MoeConfig(**{**TINY_COMMON, "num_hidden_layers": 3}, head_dim=32, tie_word_embeddings=True,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                              mlp_only_layers=[2])
    if kind == "mixtral":  # 4 experts of intermediate_size, top 2
        from transformers import MixtralConfig
        return MixtralConfig(**{**TINY_COMMON, "num_hidden_layers": 3}, num_local_experts=4, num_experts_per_tok=2,
                             tie_word_embeddings=False)
    if kind == "olmoe":  # 8 experts, top 2 not renormalised; q / k norms over all heads; qkv clipped
        from transformers import OlmoeConfig
        return OlmoeConfig(**{**TINY_COMMON, "num_hidden_layers": 3, "intermediate_size": 32}, num_experts=8,
                           num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=2.0, tie_word_embeddings=False)
    if kind == "gemma3":
        # Gemma 3's shape in small: sliding-window layers (a window of 8, so that every test
        # prompt outgrows it) around a global one, each kind with its own RoPE (the global
        # one linearly scaled), a query scale that is not head_dim's, final logit soft-capping.
        from transformers import Gemma3TextConfig
        return Gemma3TextConfig(**{**TINY_COMMON, "rms_norm_eps": 1e-6, "num_hidden_layers": 3}, head_dim=32,
                                tie_word_embeddings=True,
                                sliding_window=8, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                rope_parameters={
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
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


# GGUF value types: sizes of the fixed-size ones (8 string, 9 array).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_without_vocabulary(src: Path, dst: Path) -> Path:
    """A copy of a GGUF file without its tokenizer arrays (the vocabulary, scores, token
    types, merges): the same tensors, byte for byte, behind a header transformers' GGUF
    reader parses in a moment (it reads a 262,144-token vocabulary one item at a time)."""
    data = memoryview(src.read_bytes())
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", data, 0)
    pos = 24

    def skip_string(p):
        (n,) = struct.unpack_from("<Q", data, p)
        return p + 8 + n

    def skip_value(p, vtype):
        if vtype == 8:
            return skip_string(p)
        if vtype == 9:
            etype, count = struct.unpack_from("<IQ", data, p)
            p += 12
            if etype == 8:
                for _ in range(count):
                    p = skip_string(p)
                return p
            return p + _FIXED[etype] * count
        return p + _FIXED[vtype]

    kept, alignment = [], 32
    for _ in range(n_kv):
        start = pos
        (klen,) = struct.unpack_from("<Q", data, pos)
        key = bytes(data[pos + 8:pos + 8 + klen]).decode()
        pos += 8 + klen
        (vtype,) = struct.unpack_from("<I", data, pos)
        end = skip_value(pos + 4, vtype)
        if key == "general.alignment":
            (alignment,) = struct.unpack_from("<I", data, pos + 4)
        if not (key.startswith("tokenizer.ggml.") and vtype == 9):
            kept.append(data[start:end])
        pos = end
    infos_start = pos
    for _ in range(n_tensors):
        pos = skip_string(pos)
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    infos = data[infos_start:pos]
    data_start = -(-pos // alignment) * alignment
    header = struct.pack("<4sIQQ", magic, version, n_tensors, len(kept)) + b"".join(kept) + bytes(infos)
    header += b"\0" * (-len(header) % alignment)
    with open(dst, "wb") as f:
        f.write(header)
        f.write(data[data_start:])
    return dst


@pytest.fixture(scope="session")
def hf_gguf_reference(tmp_path_factory):
    """Factory: a packaged GGUF model's name -> transformers' float32 model of the same
    file (its own GGUF loading and dequantization: the reference our loader is checked
    against), read from a copy without the vocabulary, which transformers' reader would
    otherwise parse item by item (16 s of Gemma 3's 29 s load; the tensors are the same bits)."""
    def load(name: str):
        from transformers import AutoModelForCausalLM

        from sluice.models.loader import load_hf_config
        src = resolve_model(name)
        folder = tmp_path_factory.mktemp("gguf-no-vocab")
        gguf_without_vocabulary(src.path, folder / src.path.name)
        # transformers' own config conversion (the one our loader keeps), passed in.
        return AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=src.path.name, config=load_hf_config(src),
                                                    dtype=torch.float32).eval()
    return load
