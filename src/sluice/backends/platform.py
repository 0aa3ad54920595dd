"""The machine sluice runs on: the CPU's instruction sets, read once, and the modes they allow.

The instruction-set ceiling is torch's own CPU capability (`torch.backends.cpu.
get_cpu_capability()`): our C++ kernels never use an ISA above what torch itself
dispatches to. On a Zen 3 that is AVX2; on a Zen 4, AVX-512 — unless torch was told
otherwise with its own `ATEN_CPU_CAPABILITY=avx2` (and oneDNN with `ONEDNN_MAX_CPU_ISA=AVX2`),
which makes an AVX-512 machine behave as an AVX2-only one from end to end: that is how
the AVX2 path is built and tested on AVX-512 machines (`make test-avx2`).

`check_modes()` refuses, with one line that says what is missing and what works instead,
every mode this CPU cannot run; the engine calls it before building kernels or loading
weights.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The x86 features our kernels and torch's fast paths care about, as /proc/cpuinfo names them.
_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
             "avx512_vnni", "avx_vnni", "avx_ne_convert", "amx_bf16")


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    # "avx512", "avx2" or "generic": the highest vector ISA that torch dispatches to here.
    isa: str
    # The _FEATURES this CPU has, limited to what `isa` allows (no avx512* under "avx2").
    flags: frozenset[str]
    # oneDNN can run bfloat16 matmuls and prepack bf16 weights (AVX-512 BW/VL/DQ or AVX-NE-CONVERT).
    onednn_bf16: bool

    @property
    def avx512_bf16(self) -> bool:
        return "avx512_bf16" in self.flags

    def describe(self) -> str:
        shown = [f for f in ("avx512_bf16", "avx512_vnni", "avx512f", "avx2", "fma") if f in self.flags]
        return f"{self.model_name or 'this CPU'} ({', '.join(shown) or 'no AVX2'})"

    def kernel_build_flags(self) -> list[str]:
        """Compiler flags that keep our kernels within `isa` on this machine."""
        flags = ["-march=native"]
        if self.isa != "avx512":
            flags.append("-mno-avx512f")   # also turns off every AVX-512 extension
        if self.isa == "generic":
            flags += ["-mno-avx2", "-mno-fma"]
        return flags


def _read_cpuinfo() -> tuple[str, set[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "", set()
    name, flags = "", set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not name:
            name = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return name, flags


def _torch_isa() -> str:
    cap = torch.backends.cpu.get_cpu_capability().upper()
    if cap.startswith("AVX512"):
        return "avx512"
    if cap.startswith("AVX2"):
        return "avx2"
    return "generic"


def _onednn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def cpu() -> CpuInfo:
    name, flags = _read_cpuinfo()
    isa = _torch_isa()
    kept = {f for f in _FEATURES if f in flags}
    if isa != "avx512":
        kept = {f for f in kept if not f.startswith("avx512")}
    if isa == "generic":
        kept -= {"avx2", "fma"}
    return CpuInfo(name, isa, frozenset(kept), _onednn_bf16())


# Mode -> (the features its kernels need, what to use instead where they are missing).
_NEEDS = {
    "deterministic mode": (("avx512_bf16",), "the default (non-deterministic) mode"),
    "quantization='w8a8'": (("avx512_bf16", "avx512_vnni"), "quantization='int8', or none"),
    "kv_cache_dtype='int8'": (("avx512_bf16", "avx512_vnni"), "kv_cache_dtype='auto'"),
}
_NAMES = {"avx512_bf16": "AVX-512 BF16", "avx512_vnni": "AVX-512 VNNI"}


def check_modes(device: str, quantization: str | None, kv_cache_dtype: str, deterministic: bool) -> None:
    """ValueError, in one line, for a mode this machine cannot run: called before any
    kernel is built or weight loaded, so the refusal is immediate and never a backend's
    traceback."""
    if not device.startswith("cpu"):
        return
    info = cpu()
    modes = [m for m, on in (("deterministic mode", deterministic), ("quantization='w8a8'", quantization == "w8a8"),
                             ("kv_cache_dtype='int8'", kv_cache_dtype == "int8")) if on]
    for mode in modes:
        needs, instead = _NEEDS[mode]
        missing = [_NAMES[f] for f in needs if f not in info.flags]
        if missing:
            raise ValueError(f"{mode} needs a CPU with {' and '.join(missing)}, which {info.describe()} lacks "
                             f"(its kernels have no AVX2 build yet); what works here: {instead}")
