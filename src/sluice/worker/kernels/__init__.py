"""Optional C++ kernels, compiled on first use with torch's extension builder.

If a compiler is missing or the build fails, `load()` returns None and callers fall
back to the torch implementation; nothing else depends on the kernels being present.
"""
from __future__ import annotations

import functools
import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger(__name__)
_DIR = Path(__file__).resolve().parent


SOURCES = ("paged_attention.cpp", "batch_invariant.cpp", "decoder_stack.cpp", "w8a8.cpp", "argmax.cpp")


def build(name: str, source_dir: Path):
    """Compile (or load the cached build of) the kernel sources in `source_dir` as module
    `name`. Raises what the build raises."""
    # torch runs `ninja` from PATH; the pip-installed one sits beside the interpreter,
    # which is not on PATH when the venv is used without being activated.
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import load as load_extension
    return load_extension(
        name=name,
        sources=[str(source_dir / source) for source in SOURCES],
        # No contraction of a * b + c into one FMA: rope_write_kv replicates torch's rounding.
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


@functools.lru_cache(maxsize=None)
def load():
    try:
        return build("sluice_cpu_kernels", _DIR)
    except Exception as e:  # no compiler, no ninja, unsupported platform
        logger.warning("C++ kernels unavailable (%s); using the torch fallback", e)
        return None


def batch_invariant(device, dtype):
    """The kernels deterministic mode needs, or a ValueError that says why they are missing."""
    import torch
    if device.type != "cpu":
        raise ValueError(f"deterministic mode runs on the CPU; its batch-invariant kernels "
                         f"have no {device.type} build yet")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"deterministic mode supports float32 and bfloat16, not {dtype}")
    mod = load()
    if mod is None:
        raise ValueError("deterministic mode needs the C++ kernels, which failed to build (see the log)")
    if not getattr(mod, "has_batch_invariant", False):
        raise ValueError("deterministic mode needs a CPU with AVX-512 BF16; this one lacks it")
    return mod


def for_model(device, dtype):
    """The kernels that run a model's linear layers, norms and SwiGLU in the default mode:
    bfloat16 on a CPU with AVX-512 BF16, where they beat oneDNN at decode batch sizes.
    None elsewhere (float32 keeps torch's own ops, which the exact-match tests against
    transformers rely on; other devices keep torch's)."""
    import torch
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    mod = load()
    return mod if mod is not None and getattr(mod, "has_batch_invariant", False) else None


def require_w8a8(mod) -> None:
    """ValueError unless `mod` (the loaded kernels, or None) can run w8a8 linear layers."""
    if mod is None:
        raise ValueError("quantization='w8a8' needs the C++ kernels on a CPU with AVX-512 BF16 (see the log)")
    if not getattr(mod, "has_w8a8", False):
        raise ValueError("quantization='w8a8' needs a CPU with AVX-512 VNNI; this one lacks it")


def require_int8_kv(mod) -> None:
    """ValueError unless `mod` (the kernels that run the model, or None) can use an int8 KV cache."""
    if mod is None:
        raise ValueError("kv_cache_dtype='int8' needs the C++ kernels on a CPU with AVX-512 BF16 (see the log)")
    if not getattr(mod, "has_w8a8", False):  # the same instructions: AVX-512 VNNI
        raise ValueError("kv_cache_dtype='int8' needs a CPU with AVX-512 VNNI; this one lacks it")
