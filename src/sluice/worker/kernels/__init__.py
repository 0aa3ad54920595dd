"""Optional C++ kernels, compiled on first use with torch's extension builder.

If a compiler is missing or the build fails, `load()` returns None and callers fall
back to the torch implementation; nothing else depends on the kernels being present.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)
_DIR = Path(__file__).resolve().parent


SOURCES = ("paged_attention.cpp", "batch_invariant.cpp", "decoder_stack.cpp", "w8a8.cpp", "argmax.cpp")

# A build whose lock file is held this long is reported in the log (a first build on 2
# cores takes ~1.5 minutes; a cached one loads in well under a second).
_SLOW_LOAD_S = 3.0


def build(name: str, source_dir: Path):
    """Compile (or load the cached build of) the kernel sources in `source_dir` as module
    `name`, within the instruction sets of backends.platform.cpu(). Raises what the build
    raises."""
    # torch runs `ninja` from PATH; the pip-installed one sits beside the interpreter,
    # which is not on PATH when the venv is used without being activated.
    bindir = os.path.dirname(sys.executable)
    if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    from torch.utils.cpp_extension import _get_build_directory, load as load_extension

    from sluice.backends.platform import cpu
    info = cpu()
    build_dir = Path(_get_build_directory(name, verbose=False))
    with _build_lock(build_dir):
        started = time.monotonic()
        # Said only when loading is slow, i.e. when a build really runs.
        notice = threading.Timer(_SLOW_LOAD_S, logger.warning, (
            "compiling sluice's C++ kernels for %s (%s; first start only, ~1.5 minutes on 2 cores) in %s",
            info.describe(), info.isa, build_dir))
        notice.daemon = True
        notice.start()
        try:
            mod = load_extension(
                name=name,
                sources=[str(source_dir / source) for source in SOURCES],
                # No contraction of a * b + c into one FMA: rope_write_kv replicates torch's rounding.
                extra_cflags=["-O3", *info.kernel_build_flags(), "-fopenmp", "-ffp-contract=off"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
        finally:
            notice.cancel()
        if time.monotonic() - started > _SLOW_LOAD_S:
            logger.warning("C++ kernels ready after %.0f s", time.monotonic() - started)
        return mod


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Serialise builds of one module across processes with an flock, which the kernel
    releases when its holder dies. torch's own lock is a plain file that a build killed
    midway leaves behind, and every later load would wait on it forever; holding our
    flock, any such file is stale by construction, so it is removed (and said)."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "sluice.flock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.warning("waiting for another process's build of the C++ kernels in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            age = time.time() - stale.stat().st_mtime
            logger.warning("removing a stale kernel build lock %s (%.0f s old; the build that left it "
                           "was interrupted) and building again", stale, age)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def module_name() -> str:
    """One cached build per instruction-set ceiling, so forcing a lower one (tests) never
    rebuilds over the native build."""
    from sluice.backends.platform import cpu
    isa = cpu().isa
    return "sluice_cpu_kernels" if isa == "avx512" else f"sluice_cpu_kernels_{isa}"


@functools.lru_cache(maxsize=None)
def load():
    try:
        return build(module_name(), _DIR)
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
        raise ValueError("deterministic mode needs the C++ kernels, which failed to build (see the log); "
                         "what works here: the default (non-deterministic) mode")
    if not getattr(mod, "has_batch_invariant", False):  # backends.platform.check_modes said yes
        raise ValueError("deterministic mode: the C++ kernels were built without AVX-512 BF16")
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
        raise ValueError("quantization='w8a8' needs the C++ kernels, which failed to build (see the log); "
                         "what works here: quantization='int8', or none")
    if not getattr(mod, "has_w8a8", False):  # backends.platform.check_modes said yes
        raise ValueError("quantization='w8a8': the C++ kernels were built without AVX-512 VNNI")


def require_int8_kv(mod) -> None:
    """ValueError unless `mod` (the kernels that run the model, or None) can use an int8 KV cache."""
    if mod is None:
        raise ValueError("kv_cache_dtype='int8' needs the C++ kernels, which failed to build (see the log); "
                         "what works here: kv_cache_dtype='auto'")
    if not getattr(mod, "has_w8a8", False):  # the same instructions as w8a8: AVX-512 VNNI
        raise ValueError("kv_cache_dtype='int8': the C++ kernels were built without AVX-512 VNNI")
