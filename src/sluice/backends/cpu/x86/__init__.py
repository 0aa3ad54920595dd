"""sluice's C++ CPU kernels: one build per instruction set, compiled on first use.

The sources in this folder are written once, in AVX-512 intrinsics, and built per ISA
variant (VARIANTS): natively for AVX-512 with BF16 and VNNI; for AVX-512 with VNNI but
no BF16 through avx512/bf16_on_avx512.h; and for AVX2 + FMA + F16C, with AVX-VNNI or
without, through avx2/avx512_on_avx2.h. Flags name the target
(x86-64-v4, x86-64-v3), never the build machine (-march=native), so a build is right for
every CPU of its variant.

Which variant runs is decided by backends/ (the CPU's features and the `cpu_isa`
setting); this module builds and loads the one asked for. Each build is cached by
variant, by the content of the sources, the flags and the torch build (its version and
commit): a cache shared by machines of different kinds never loads AVX-512 code on an
AVX2 CPU, and the same sources with the same torch share one build, anything else gets
its own. Sources are staged into the build folder, so the compiler commands do not depend
on where the checkout is; a finished build is loaded as it is, without the build tool,
whose commands name torch's headers by their path: so a fresh clone's virtualenv (CI's
every run) loads the kernels an earlier one built instead of compiling them again.

If a compiler is missing or the build fails, `load()` returns None (logged) and the
backend layer falls back to torch's own ops.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import sys
import threading
import time
from pathlib import Path

logger = logging.getLogger(__name__)
_DIR = Path(__file__).resolve().parent


# Compiler flags per variant. x86-64-v4 is AVX-512 F/BW/CD/DQ/VL; x86-64-v3 is AVX2, FMA,
# F16C, BMI1/2, LZCNT and MOVBE (every AVX2 CPU from Haswell and Zen 1 on).
# avx2_vnni is the AVX2 build plus AVX-VNNI's 256-bit vpdpbusd (Intel's AVX2 cores since
# Alder Lake and Sierra Forest, which have no AVX-512): the int8 dot products of w8a8 and
# of the int8 KV cache take one instruction per 32 byte products instead of four.
# avx512_vnni is the AVX-512 build without BF16 (Intel's Cascade Lake, Ice Lake, Tiger
# and Rocket Lake): vdpbf16ps and the bf16 conversions in a few AVX-512 instructions each,
# everything else as the avx512 build runs it.
VARIANTS: dict[str, tuple[str, ...]] = {
    "avx512": ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    "avx512_vnni": ("-march=x86-64-v4", "-mavx512vnni"),
    "avx2_vnni": ("-march=x86-64-v3", "-mavxvnni", "-DSLUICE_AVX2", "-DSLUICE_AVX_VNNI"),
    "avx2": ("-march=x86-64-v3", "-DSLUICE_AVX2"),
}
# No contraction of a * b + c into one FMA: rope_write_kv replicates torch's rounding.
_COMMON_CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")

# A build whose lock file is held this long is reported in the log (a first build on 2
# cores takes ~35 s; a cached one loads in well under a second).
_SLOW_LOAD_S = 3.0


def _sources(source_dir: Path) -> list[str]:
    """The translation units: every *.cpp in the folder (a revision's own, for
    benchmarks/ab_kernels.py). The two that take longest to compile first, so that the
    build's other jobs overlap them: paged_attention.cpp (~20 s alone: its routines for
    every head size and group) and bindings.cpp (~16 s: torch's pybind11 headers, aten.h)."""
    first = ("paged_attention.cpp", "bindings.cpp")
    return sorted((p.name for p in source_dir.glob("*.cpp")),
                  key=lambda n: (first.index(n) if n in first else len(first), n))


def _files(source_dir: Path) -> list[Path]:
    """What a build reads: the translation units and every *.h under the folder."""
    headers = sorted(p.relative_to(source_dir) for p in source_dir.rglob("*.h"))
    return [Path(s) for s in _sources(source_dir)] + headers


def build_key(variant: str, source_dir: Path = _DIR) -> str:
    """12 hex digits over everything a build depends on: its variant's flags, the torch
    build it compiles against (version and commit, not where it is installed: the same
    wheel in two virtualenvs has the same headers and library), the Python version, and
    the names and bytes of every source and header."""
    import torch
    h = hashlib.sha256()
    h.update(repr((variant, VARIANTS[variant], _COMMON_CFLAGS, torch.__version__, torch.version.git_version,
                   sys.version_info[:2])).encode())
    for rel in _files(source_dir):
        h.update(str(rel).encode() + b"\0" + (source_dir / rel).read_bytes() + b"\0")
    return h.hexdigest()[:12]


def module_name(variant: str, source_dir: Path = _DIR) -> str:
    return f"sluice_kernels_{variant}_{build_key(variant, source_dir)}"


def _ninja_beside_interpreter_first() -> None:
    """torch runs `ninja` from PATH. The pip-installed one (a dependency) sits beside the
    interpreter, which is not on PATH when the venv is used without being activated: a
    system ninja then builds instead. Two ninja versions hash a build's commands
    differently (1.11 and 1.13 do), so each finds the other's objects stale, and a server
    started with the venv activated after tests run without (or the reverse) rebuilt every
    kernel file, ~35 s. So the venv's ninja goes first on PATH whenever there is one."""
    bindir = os.path.dirname(sys.executable)
    if not os.path.exists(os.path.join(bindir, "ninja")):
        return
    path = os.environ.get("PATH", "")
    if path.split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + path if path else bindir


def build(variant: str, source_dir: Path = _DIR):
    """Compile (or load the cached build of) the kernel sources in `source_dir` for
    `variant`. Raises what the build raises."""
    if variant not in VARIANTS:
        raise ValueError(f"no kernel build for {variant!r}; variants: {', '.join(VARIANTS)}")
    _ninja_beside_interpreter_first()
    from torch.utils.cpp_extension import _get_build_directory, load as load_extension

    name = module_name(variant, source_dir)
    build_dir = Path(_get_build_directory(name, verbose=False))
    cflags = [*_COMMON_CFLAGS, *VARIANTS[variant]]
    with _build_lock(build_dir):
        mod = _load_built(name, build_dir)
        if mod is not None:
            mod.isa = variant
            return mod
        staged = _stage(source_dir, build_dir / "src")
        started = time.monotonic()
        # Said only when loading is slow, i.e. when a build really runs.
        notice = threading.Timer(_SLOW_LOAD_S, logger.warning, (
            "compiling sluice's C++ kernels for %s (first start only, ~35-80 s on 2 cores) in %s",
            variant, build_dir))
        notice.daemon = True
        notice.start()
        try:
            if not (build_dir / f"{name}.so").exists():  # a first build: every file compiles
                _precompile_header(staged, name, cflags)
            mod = load_extension(
                name=name,
                sources=[str(staged / s) for s in _sources(source_dir)],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
        finally:
            notice.cancel()
            # 260 MB, needed by no later load: the files' dependency lists name aten.h, not
            # its precompiled form, so the build tool's checks never miss it.
            (staged / (_PCH + ".gch")).unlink(missing_ok=True)
        if time.monotonic() - started > _SLOW_LOAD_S:
            logger.warning("C++ kernels (%s) ready after %.0f s", variant, time.monotonic() - started)
        mod.isa = variant
        return mod


def _load_built(name: str, build_dir: Path):
    """The finished build in `build_dir`, imported as it is; None where there is none or it
    does not load (a link cut short), and the build tool runs. Not through torch's loader:
    its build tool would compile everything again wherever torch's headers lie elsewhere
    than in the environment that built it (another virtualenv of the same torch)."""
    import importlib.util
    path = build_dir / f"{name}.so"
    if not path.exists():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001 (built again below)
        logger.warning("the cached C++ kernels %s do not load (%s); building them again", path, e)
        return None
    return mod


# The header every translation unit includes first (ATen's tensor type and factories).
_PCH = "aten.h"


def pch_cflags(name: str, extra_cflags: list[str]) -> list[str]:
    """The flags cpp_extension compiles each of the module's files with (its
    _write_ninja_file_to_build_library's `cflags`, which tests/unit/test_platform.py
    compares with these), which the precompiled header must be made with."""
    import sysconfig

    from torch.utils import cpp_extension as ce
    includes = [*ce.include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(f for inc in includes for f in ("-isystem", inc)), "-fPIC", "-std=c++20", *extra_cflags]


def _precompile_header(src: Path, name: str, extra_cflags: list[str]) -> None:
    """Compile aten.h once into GCC's precompiled form (aten.h.gch beside it), which GCC
    reads in place of the header in every file that includes it first. Parsing ATen's
    headers was ~9 s of each file's ~12 s on a 2.45 GHz Zen 3: ~100 of the build's ~215 s
    of CPU, eleven times over. The flags are the ones cpp_extension gives each file
    (_write_ninja_file_to_build_library's); where they differ GCC ignores the .gch and
    parses the header as if it were not there, so a mismatch costs time, never
    correctness. Best effort: without GCC, or if this fails, the build runs as before."""
    import shlex
    import subprocess

    from torch.utils import cpp_extension as ce
    tmp = src / (_PCH + ".gch.tmp")
    try:
        compiler = ce.get_cxx_compiler()
        if not ce.check_compiler_is_gcc(compiler):
            return
        out = src / (_PCH + ".gch")
        cmd = [*shlex.split(compiler), "-x", "c++-header", str(src / _PCH), "-o", str(tmp),
               *pch_cflags(name, extra_cflags)]
        subprocess.run(cmd, check=True, capture_output=True)
        os.replace(tmp, out)
    except Exception as e:  # noqa: BLE001 (an optimisation: the build goes on without it)
        tmp.unlink(missing_ok=True)  # a failed compile may leave a partial file
        logger.info("no precompiled header for the C++ kernels (%s); building without", e)


def _stage(source_dir: Path, dest: Path) -> Path:
    """Copy the sources into the build folder, rewriting only what differs (the build
    tool compares modification times)."""
    for rel in _files(source_dir):
        data = (source_dir / rel).read_bytes()
        target = dest / rel
        if not target.exists() or target.read_bytes() != data:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return dest


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


@functools.lru_cache(maxsize=None)
def load(variant: str | None = None):
    """The kernels of `variant` ("avx512", "avx512_vnni", "avx2_vnni", "avx2"), by default the best this CPU runs;
    None where there is none or the build failed (logged)."""
    if variant is None:  # one cached load per variant, however it was asked for
        from sluice.backends.platform import cpu
        return load(cpu().best_isa)
    if variant not in VARIANTS:
        return None
    try:
        return build(variant)
    except Exception as e:  # no compiler, no ninja, unsupported platform
        logger.warning("C++ kernels (%s) unavailable (%s); using the torch fallback", variant, e)
        return None
