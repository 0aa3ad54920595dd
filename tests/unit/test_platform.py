"""The machine's features, the kernel builds and modes they allow, and the backend plan: a
mode that cannot run is refused in one line before anything loads, on whichever kind of
machine the suite runs (other kinds' CPUs are described here by hand); kernel builds are
cached by variant and content and survive a killed build."""
from __future__ import annotations

import logging
import re
import os
import subprocess
import sys
import time

import pytest
import torch

from sluice.backends import platform
from sluice.backends.platform import CpuInfo

V3 = frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"})
ZEN3 = CpuInfo("AMD EPYC 7B13 64-Core Processor", V3, False)
ZEN4 = CpuInfo("AMD EPYC 9B14 96-Core Processor",
               V3 | {"avx512f", "avx512bw", "avx512cd", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}, True)
ICELAKE = CpuInfo("Intel Xeon Platinum 8375C", V3 | {"avx512f", "avx512bw", "avx512cd", "avx512vl", "avx512dq",
                                                     "avx512_vnni"}, True)   # AVX-512 without BF16
OLD = CpuInfo("Intel Xeon E5-2670", frozenset(), False)                     # Sandy Bridge: AVX only
ALDERLAKE = CpuInfo("12th Gen Intel Core i7-1260P", V3 | {"avx_vnni"}, False)  # AVX2 + AVX-VNNI, no AVX-512
SPR = CpuInfo("Intel Xeon Platinum 8481C", ZEN4.flags | {"avx_vnni", "amx_bf16"}, True)


@pytest.fixture
def as_cpu(monkeypatch):
    def use(info: CpuInfo):
        monkeypatch.setattr(platform, "cpu", lambda: info)
    return use


def test_kernel_builds_each_cpu_runs():
    assert ZEN4.isas == ("avx512", "avx512_vnni", "avx2", "generic")
    assert ICELAKE.isas == ("avx512_vnni", "avx2", "generic") and ICELAKE.resolve_isa("auto") == "avx512_vnni"
    assert ZEN3.isas == ("avx2", "generic")
    assert OLD.isas == ("generic",)
    assert ALDERLAKE.isas == ("avx2_vnni", "avx2", "generic")
    assert SPR.isas == ("avx512", "avx512_vnni", "avx2_vnni", "avx2", "generic")
    assert ALDERLAKE.resolve_isa("auto") == "avx2_vnni" and SPR.resolve_isa("avx2_vnni") == "avx2_vnni"
    info = platform.cpu()
    assert info.isas[-1] == "generic" and info.describe()
    assert ZEN4.resolve_isa("auto") == "avx512" and ZEN4.resolve_isa("avx2") == "avx2"
    assert ZEN3.resolve_isa("generic") == "generic"


def test_a_build_the_cpu_cannot_run_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^cpu_isa='avx512' needs avx512f, .*avx512_vnni, which AMD EPYC 7B13 .* "
                                         r"lacks; what runs here: avx2, generic$"):
        ZEN3.resolve_isa("avx512")
    with pytest.raises(ValueError, match=r"^cpu_isa='avx2_vnni' needs avx_vnni, which AMD EPYC 9B14 .* lacks; "
                                         r"what runs here: avx512, avx512_vnni, avx2, generic$"):
        ZEN4.resolve_isa("avx2_vnni")
    with pytest.raises(ValueError, match=r"^cpu_isa='avx512' needs avx512_bf16, which Intel Xeon Platinum 8375C .* "
                                         r"lacks; what runs here: avx512_vnni, avx2, generic$"):
        ICELAKE.resolve_isa("avx512")
    with pytest.raises(ValueError, match="cpu_isa must be one of auto, avx512, avx512_vnni, avx2_vnni, avx2, generic"):
        ZEN4.resolve_isa("sse4")


def test_variant_flags_name_the_target_not_the_build_machine():
    from sluice.backends.cpu.x86 import VARIANTS
    assert VARIANTS["avx512"][0] == "-march=x86-64-v4" and VARIANTS["avx2"][0] == "-march=x86-64-v3"
    assert VARIANTS["avx2_vnni"][:2] == ("-march=x86-64-v3", "-mavxvnni")
    assert VARIANTS["avx512_vnni"] == ("-march=x86-64-v4", "-mavx512vnni")  # and no -mavx512bf16
    assert not any("native" in f for flags in VARIANTS.values() for f in flags)


@pytest.mark.parametrize("mode, kwargs, instead", [
    ("deterministic mode", dict(deterministic=True), "the default (non-deterministic) mode"),
    ("quantization='w8a8'", dict(quantization="w8a8"), "quantization='int8', or none"),
    ("quantization='w4a8'", dict(quantization="w4a8"), "quantization='int8', or none"),
    ("kv_cache_dtype='int8'", dict(kv_cache_dtype="int8"), "kv_cache_dtype='auto'"),
])
def test_kernel_modes_without_kernels_are_refused_in_one_line_before_loading(as_cpu, monkeypatch, mode, kwargs,
                                                                             instead):
    from sluice.engine import llm_engine
    from sluice.backends.cpu import x86 as kernels

    def must_not_run(*_):
        raise AssertionError("the refusal came after loading began")
    monkeypatch.setattr(llm_engine, "resolve_model", must_not_run)
    monkeypatch.setattr(kernels, "load", must_not_run)
    for info, isa, why in ((OLD, "auto", "Intel Xeon E5-2670 (no AVX2) has no AVX2"),
                           (ZEN4, "generic", "cpu_isa='generic' runs torch's own ops")):
        as_cpu(info)
        with pytest.raises(ValueError) as e:
            llm_engine.LLMEngine.from_kwargs(dtype="bfloat16", cpu_isa=isa, **kwargs)
        msg = str(e.value)
        assert "\n" not in msg and "Traceback" not in msg
        assert msg == (f"{mode} needs sluice's C++ kernels (an AVX2 or AVX-512 CPU), and {why}; "
                       f"what works here: {instead}")


def test_a_failed_build_is_refused_for_kernel_modes_and_falls_back_otherwise(as_cpu, monkeypatch, caplog):
    from sluice.backends.cpu import x86 as kernels
    from sluice.backends.select import select
    from sluice.config import EngineConfig
    monkeypatch.setattr(kernels, "load", lambda isa=None: None)
    as_cpu(ZEN3)
    cfg = EngineConfig.from_kwargs(deterministic=True)
    with pytest.raises(ValueError, match=r"^deterministic mode needs sluice's C\+\+ kernels, which failed to build"):
        select(cfg.model, cfg.cache)
    cfg = EngineConfig.from_kwargs()
    with caplog.at_level(logging.WARNING, logger="sluice.backends.select"):
        plan = select(cfg.model, cfg.cache)
    assert plan.isa == "generic" and plan.linear == "torch" and plan.dtype == torch.float32
    assert "did not build" in caplog.text


def test_every_mode_is_accepted_on_avx2(as_cpu):
    from sluice.backends.cpu.backend import check
    as_cpu(ZEN3)
    assert check("auto", "w8a8", "int8", True) == "avx2"
    as_cpu(OLD)
    assert check("auto", "int8", "auto", False) == "generic"  # int8 weights run on torch's kernels


def test_dtype_auto_follows_the_kernels(as_cpu):
    from sluice.backends.select import resolve_dtype
    as_cpu(ZEN3)
    assert resolve_dtype("auto", "cpu") == torch.bfloat16          # the AVX2 kernels run bf16
    assert resolve_dtype("auto", "cpu", "generic") == torch.float32  # oneDNN has no bf16 there
    as_cpu(ZEN4)
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", "cpu", "generic") == torch.bfloat16
    as_cpu(OLD)
    assert resolve_dtype("auto", "cpu") == torch.float32


def test_build_cache_is_keyed_by_variant_and_source_content(tmp_path):
    """Two checkouts of the same sources share one build, and so do two virtualenvs of the
    same torch; a changed byte in any source or header is another build, and so is
    another torch; the variants never share one."""
    import shutil
    from sluice.backends.cpu import x86 as kernels
    src = kernels._DIR
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        shutil.copytree(src, d, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    assert kernels.build_key("avx2", a) == kernels.build_key("avx2", b) == kernels.build_key("avx2", src)
    assert kernels.build_key("avx2", a) != kernels.build_key("avx512", a)
    # The same torch in another virtualenv: the same build. Another torch: another build.
    import torch
    real, here = (torch.__file__, torch.__version__), kernels.build_key("avx2", a)
    try:
        torch.__file__ = str(tmp_path / "other-venv" / "torch" / "__init__.py")
        assert kernels.build_key("avx2", a) == here
        torch.__version__ = real[1] + ".post1"
        assert kernels.build_key("avx2", a) != here
    finally:
        torch.__file__, torch.__version__ = real
    (b / "avx2" / "avx512_on_avx2.h").write_text((b / "avx2" / "avx512_on_avx2.h").read_text() + "\n")
    assert kernels.build_key("avx2", b) != kernels.build_key("avx2", a)
    # Staging rewrites only what differs, so the build tool sees unchanged files as unchanged.
    staged = kernels._stage(a, tmp_path / "staged")
    before = {p: p.stat().st_mtime_ns for p in staged.rglob("*") if p.is_file()}
    time.sleep(0.01)
    kernels._stage(a, tmp_path / "staged")
    assert before == {p: p.stat().st_mtime_ns for p in staged.rglob("*") if p.is_file()}
    assert (staged / "avx2" / "avx512_on_avx2.h").exists() and (staged / "kernels.h").exists()


def test_a_finished_build_loads_without_the_build_tool(monkeypatch):
    """A fresh virtualenv of the same torch (a fresh clone's, CI's) finds the kernels built
    before and imports them as they are: torch's loader, whose build tool compares
    compiler commands that name the headers by path, would compile them all again."""
    from torch.utils import cpp_extension as ce

    from sluice.backends.cpu import x86 as kernels
    from sluice.backends.platform import cpu
    if "avx2" not in cpu().isas:
        pytest.skip("this CPU runs no AVX2 build")
    assert kernels.load("avx2") is not None  # built here if no earlier run did

    def build_tool(*args, **kwargs):
        raise AssertionError("torch's loader ran for a finished build")
    monkeypatch.setattr(ce, "load", build_tool)
    mod = kernels.build("avx2")
    assert mod.isa == "avx2" and hasattr(mod, "w4a8_pack_weight")


def test_the_precompiled_header_is_made_with_the_flags_every_file_compiles_with(tmp_path):
    """GCC reads aten.h.gch in place of aten.h only where the flags match; where they differ
    it parses the header again and a first build loses ~40 s. So the header's flags are
    the ones torch's build file gives each kernel file, and each file includes aten.h
    first (a .gch serves only a file's first include)."""
    import shlex
    from torch.utils import cpp_extension as ce
    from sluice.backends.cpu import x86 as kernels
    flags = [*kernels._COMMON_CFLAGS, *kernels.VARIANTS["avx2"]]
    ce._write_ninja_file_to_build_library(str(tmp_path / "build.ninja"), "sluice_kernels_x", ["a.cpp"], flags,
                                          [], [], [], [], with_cuda=False, with_sycl=False, is_standalone=False)
    line = next(ln for ln in (tmp_path / "build.ninja").read_text().splitlines() if ln.startswith("cflags = "))
    assert shlex.split(line.removeprefix("cflags = ")) == kernels.pch_cflags("sluice_kernels_x", flags)
    for source in kernels._sources(kernels._DIR):
        first = next(ln for ln in (kernels._DIR / source).read_text().splitlines() if ln.startswith("#include"))
        assert first.split("//")[0].strip() == f'#include "{kernels._PCH}"', source


def test_the_venvs_ninja_builds_whether_or_not_the_venv_is_activated(tmp_path, monkeypatch):
    """Another ninja on PATH (a system one) would find the venv's ninja's objects stale
    (their command hashes differ) and rebuild every kernel file: the ninja beside the
    interpreter goes first, once."""
    from sluice.backends.cpu import x86 as kernels
    bindir = tmp_path / "venv" / "bin"
    bindir.mkdir(parents=True)
    (bindir / "ninja").write_text("")
    monkeypatch.setattr(sys, "executable", str(bindir / "python"))
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin")
    kernels._ninja_beside_interpreter_first()
    kernels._ninja_beside_interpreter_first()
    assert os.environ["PATH"] == f"{bindir}:/usr/local/bin:/usr/bin"
    (bindir / "ninja").unlink()  # none beside the interpreter: PATH as it was
    monkeypatch.setenv("PATH", "/usr/bin")
    kernels._ninja_beside_interpreter_first()
    assert os.environ["PATH"] == "/usr/bin"


def _evex_instructions(path: str) -> list[str]:
    """The instructions of a binary that are EVEX-encoded (AVX-512: first byte 0x62 in
    64-bit code, after at most an address-size or segment prefix) or name zmm or mask
    registers, as objdump disassembles them (address, bytes, instruction)."""
    out = subprocess.run(["objdump", "-d", path], capture_output=True, text=True, check=True).stdout
    bad = []
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) < 3 or not fields[0].rstrip().endswith(":"):
            continue
        code = fields[1].split()
        while code and code[0] in ("67", "2e", "3e", "26", "36", "64", "65"):
            code = code[1:]
        if (code and code[0] == "62") or "%zmm" in fields[2] or "%k" in fields[2]:
            bad.append(line)
    return bad


@pytest.mark.requires("kernels")
def test_avx2_builds_hold_no_avx512_instruction(kernel_isa):
    """An AVX2 build runs on CPUs without AVX-512: neither the compiler (-march=x86-64-v3)
    nor our inline asm may emit an EVEX instruction (GAS encodes vpdpbusd on ymm as EVEX
    unless told {vex}, which would fault on an Alder Lake)."""
    import shutil
    from sluice.backends.cpu import x86 as kernels
    if kernel_isa.startswith("avx512"):
        pytest.skip("the AVX-512 builds are meant to hold AVX-512 instructions")
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils) to read the build")
    bad = _evex_instructions(kernels.load(kernel_isa).__file__)
    assert not bad, bad[:5]


@pytest.mark.requires("kernels")
def test_the_avx512_vnni_build_holds_no_bf16_instruction():
    """The avx512_vnni build runs on AVX-512 CPUs without BF16 (Ice Lake): nothing in it may
    be one of BF16's instructions, which would fault there, however rarely its path runs."""
    import shutil
    from sluice.backends.cpu import x86 as kernels
    from tests.conftest import ALL_KERNEL_ISAS
    if "avx512_vnni" not in ALL_KERNEL_ISAS:
        pytest.skip(f"{platform.cpu().describe()} does not run the avx512_vnni build")
    if shutil.which("objdump") is None:
        pytest.skip("needs objdump (binutils) to read the build")
    out = subprocess.run(["objdump", "-d", kernels.load("avx512_vnni").__file__], capture_output=True, text=True,
                         check=True).stdout
    assert "vpdpbusd" in out  # VNNI's, from our kernels: the disassembly is the build's
    bad = [line for line in out.splitlines() if re.search(r"\tv(dpbf16ps|cvtneps2bf16|cvtne2ps2bf16)\b", line)]
    assert not bad, bad[:5]


@pytest.mark.requires("kernels")
def test_the_plan_is_logged_in_one_line(tiny_checkpoint, caplog, kernel_isa):
    from sluice.engine.llm_engine import LLMEngine
    path = str(tiny_checkpoint("llama"))
    with caplog.at_level(logging.INFO, logger="sluice.backends.select"):
        e = LLMEngine.from_kwargs(model=path, num_blocks=32, cpu_isa=kernel_isa, quantization="w8a8",
                                  kv_cache_dtype="int8")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend:")]
    assert lines == [e.backend.line()]
    head = "kernels-greedy-w8a7" if kernel_isa == "avx2" else "kernels-greedy-w8a8"  # no sign trick for the head
    assert lines[0] == (f"backend: cpu isa={kernel_isa} dtype=bfloat16 linear=kernels-w8a8 attention=kernels-varlen "
                        f"kv=int8 norm=kernels rope=kernels head={head} deterministic=off")
    f32 = LLMEngine.from_kwargs(model=path, num_blocks=32, cpu_isa=kernel_isa, dtype="float32")
    assert f32.backend.line() == (f"backend: cpu isa={kernel_isa} dtype=float32 linear=torch "
                                  "attention=kernels-decode+sdpa kv=float32 norm=torch rope=torch head=torch "
                                  "deterministic=off")


def test_stale_build_lock_is_broken_with_a_log_line(tmp_path, caplog):
    """A build killed midway leaves torch's lock file; the next load removes it (holding
    our flock, no live build can own it) instead of waiting forever."""
    from sluice.backends.cpu.x86 import _build_lock
    (tmp_path / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger="sluice.backends.cpu.x86"):
        with _build_lock(tmp_path):
            assert not (tmp_path / "lock").exists()
    assert "stale kernel build lock" in caplog.text


def test_a_live_build_is_waited_for_and_said(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time\n"
        f"f = open({str(tmp_path / 'sluice.flock')!r}, 'w'); fcntl.flock(f, fcntl.LOCK_EX)\n"
        "print('held', flush=True); time.sleep(1.0)")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    from sluice.backends.cpu.x86 import _build_lock
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="sluice.backends.cpu.x86"):
        with _build_lock(tmp_path):
            waited = time.monotonic() - t0
    holder.wait(5)
    assert "waiting for another process's build" in caplog.text
    assert waited > 0.3  # it did wait for the holder (who held it ~1 s), not barge in


# Every mode's plan, per kernel build: what each build runs for it (the kernel builds share
# one plan but for the greedy head, which on plain AVX2 takes 7-bit activations).
MODES = {
    "default": dict(),                     # the default model is a Q4_1 GGUF: w4a8 ("auto")
    "full precision": dict(quantization=None),
    "float32": dict(dtype="float32"),
    "int8": dict(quantization="int8"),
    "w8a8": dict(quantization="w8a8"),
    "w4a8": dict(quantization="w4a8"),
    "kv int8": dict(kv_cache_dtype="int8"),
    "w4a8 + kv int8": dict(quantization="w4a8", kv_cache_dtype="int8"),
    "deterministic": dict(deterministic=True),
    "deterministic w4a8": dict(deterministic=True, quantization="w4a8"),
}


def expected_line(isa: str, mode: str) -> str:
    kw = MODES[mode]
    if kw.get("dtype") == "float32":
        return (f"backend: cpu isa={isa} dtype=float32 linear=torch attention=kernels-decode+sdpa kv=float32 "
                f"norm=torch rope=torch head=torch deterministic=off")
    det = kw.get("deterministic", False)
    q = kw["quantization"] if "quantization" in kw else None if det else "w4a8"
    linear = {None: "kernels", "int8": "kernels-int8", "w8a8": "kernels-w8a8", "w4a8": "kernels-w4a8"}[q]
    head = "kernels" if det else "kernels-greedy-w8a7" if isa == "avx2" else "kernels-greedy-w8a8"
    kv = kw.get("kv_cache_dtype", "bfloat16").replace("auto", "bfloat16")
    return (f"backend: cpu isa={isa} dtype=bfloat16 linear={linear} attention=kernels-varlen kv={kv} norm=kernels "
            f"rope=kernels head={head} deterministic={'on' if det else 'off'}")


@pytest.mark.requires("kernels")
@pytest.mark.parametrize("mode", list(MODES))
def test_the_plan_of_every_mode_on_every_build(kernel_isa, mode):
    """The backend each (kernel build, mode) pair this machine runs gets, as its plan line,
    before any weight loads."""
    from sluice.backends.select import select
    from sluice.config import EngineConfig
    cfg = EngineConfig.from_kwargs(cpu_isa=kernel_isa, **MODES[mode])
    assert select(cfg.model, cfg.cache, log=False).line() == expected_line(kernel_isa, mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_generic_plan_or_refusal_of_every_mode(mode):
    """torch's own ops (cpu_isa='generic'): a plan where they run the mode, else one line."""
    from sluice.backends.platform import cpu
    from sluice.backends.select import select
    from sluice.config import EngineConfig
    kw = MODES[mode]
    if kw.get("deterministic") or kw.get("kv_cache_dtype") or kw.get("quantization") in ("w8a8", "w4a8"):
        with pytest.raises(ValueError, match=r"needs sluice's C\+\+ kernels .* cpu_isa='generic' runs torch's own "
                                             r"ops; what works here: "):
            EngineConfig.from_kwargs(cpu_isa="generic", **kw)
        return
    cfg = EngineConfig.from_kwargs(cpu_isa="generic", **{"dtype": "bfloat16", **kw})
    prepack = cpu().onednn_bf16 and cfg.model.dtype != "float32"
    linear = {None: "onednn-bf16" if prepack else "torch",
              "int8": "torch-int8+onednn-bf16" if prepack else "torch-int8"}[kw.get("quantization")]
    if cfg.model.dtype == "float32":
        linear = "torch" if kw.get("quantization") is None else linear
    dtype = cfg.model.dtype
    head = "torch" if linear == "torch" else linear
    assert select(cfg.model, cfg.cache, log=False).line() == (
        f"backend: cpu isa=generic dtype={dtype} linear={linear} attention=torch-matmul-decode+sdpa kv={dtype} "
        f"norm=torch rope=torch head={head} deterministic=off")


def test_the_cuda_plan_and_its_refusals(monkeypatch):
    """The CUDA backend's plan (on CPU tensors under Triton's interpreter where there is no
    GPU) and what it refuses."""
    pytest.importorskip("triton")
    from sluice.backends import select
    from sluice.config import EngineConfig
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setitem(select.FAMILIES, "cpu", ("sluice.backends.cuda.backend", "CudaBackend"))
    cfg = EngineConfig.from_kwargs(device=device, enforce_eager=True)
    assert cfg.scheduler.max_num_batched_tokens == 2048
    assert select.select(cfg.model, cfg.cache, log=False).line() == (
        f"backend: {device} dtype=bfloat16 linear=cublas attention=triton-varlen+splitk kv=bfloat16 norm=triton "
        f"rope=triton head=cublas graphs=off deterministic=off")


HARDWARE = re.compile(r"\b(cpu|cuda|gpu|avx\w*|isa|kernels?|triton|onednn|mkldnn|x86|bfloat16|"
                      r"is_available|mem_get_info|device_type)\b", re.IGNORECASE)


def code_names(path) -> list[tuple[int, str]]:
    """(line, name) of every identifier and attribute in a Python file's code: comments and
    strings (docstrings included) left out."""
    import io
    import tokenize
    with open(path, "rb") as f:
        toks = tokenize.tokenize(io.BytesIO(f.read()).readline)
        return [(t.start[0], t.string) for t in toks if t.type == tokenize.NAME]


def test_no_hardware_branch_outside_backends():
    """models/, the runner, engine/ and config.py ask the backend; they name no device,
    ISA, kernel or hardware dtype in their code (what their comments say is free), and
    import no family's backend."""
    from pathlib import Path
    src = Path(__file__).resolve().parents[2] / "src" / "sluice"
    files = [*sorted((src / "models").glob("*.py")), src / "worker" / "model_runner.py",
             *sorted((src / "engine").glob("*.py")), src / "config.py"]
    found = [f"{p.relative_to(src)}:{line}: {name}" for p in files for line, name in code_names(p)
             if HARDWARE.fullmatch(name)]
    assert not found, found
    imports = [f"{p.relative_to(src)}: {line.strip()}" for p in files for line in p.read_text().splitlines()
               if re.match(r"\s*(from|import) sluice\.backends\.(cpu|cuda)\b", line)]
    assert not imports, imports


@pytest.mark.requires("kernels")
def test_auto_quantization_runs_a_q4_1_gguf_in_its_own_form(kernel_isa, tiny_checkpoint, monkeypatch):
    """quantization='auto' (the default): the default model, a GGUF whose linear weights are
    all Q4_1, runs w4a8 in bfloat16, other quantized GGUFs gguf; a Hugging Face folder, float32, deterministic mode,
    tensor parallelism and random weights run in full precision, and so does an explicit
    None. Where the kernels do not build, the automatic choice falls back to full precision
    while an explicit w4a8 is refused."""
    from sluice.backends import select
    from sluice.backends.cpu import x86
    from sluice.config import EngineConfig
    from sluice.entrypoints.cli import build_parser
    cfg = EngineConfig.from_kwargs(cpu_isa=kernel_isa)
    assert (cfg.model.quantization, cfg.model.quantization_auto) == ("w4a8", True)
    # A Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 matrices): its own blocks.
    cfg = EngineConfig.from_kwargs(model="gemma3-270m", cpu_isa=kernel_isa)
    assert (cfg.model.quantization, cfg.model.quantization_auto) == ("gguf", True)
    for kw in (dict(model=str(tiny_checkpoint("llama"))), dict(dtype="float32"), dict(deterministic=True),
               dict(tensor_parallel_size=2), dict(load_format="dummy"), dict(quantization=None)):
        assert EngineConfig.from_kwargs(cpu_isa=kernel_isa, **kw).model.quantization is None, kw
    args = build_parser().parse_args(["serve", "--quantization", "none"])
    assert args.quantization == "none"
    assert build_parser().parse_args(["serve"]).quantization == "auto"
    monkeypatch.setattr(x86, "load", lambda isa: None)
    cfg = EngineConfig.from_kwargs(cpu_isa=kernel_isa)
    assert not select.select(cfg.model, cfg.cache, log=False).linear.startswith("kernels")
    assert cfg.model.quantization is None
    cfg = EngineConfig.from_kwargs(cpu_isa=kernel_isa, quantization="w4a8")
    with pytest.raises(ValueError, match="failed to build"):
        select.select(cfg.model, cfg.cache, log=False)


def test_device_auto_is_cuda_where_torch_sees_a_gpu(monkeypatch):
    """device='auto' (the default, and `sluice serve`'s): cuda where torch sees a GPU, else
    cpu; the backend line then says which family runs. (The suite pins auto to cpu:
    tests/conftest.py; this checks the machine's own answer.)"""
    from sluice.backends import select
    from sluice.config import EngineConfig
    monkeypatch.setattr(select, "auto_device", AUTO_DEVICE)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert select.auto_device() == "cuda"
    assert select.family("auto").family == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert select.auto_device() == "cpu"
    config = EngineConfig.from_kwargs()
    assert config.model.device == "cpu" and select.family(config.model.device).family == "cpu"
    with pytest.raises(ValueError, match="is not a torch device"):
        select.family("tpu:0")


# The function itself, taken before the suite's session fixture pins device='auto' to cpu.
AUTO_DEVICE = __import__("sluice.backends.select", fromlist=["auto_device"]).auto_device
