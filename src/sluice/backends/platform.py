"""The machine sluice runs on: the CPU's features, read once, and the kernel builds it can run.

`cpu()` reads /proc/cpuinfo once. `CpuInfo.isas` lists the kernel variants this CPU can
execute, best first: "avx512" (AVX-512 F/BW/DQ/VL with BF16 and VNNI: Zen 4, Sapphire
Rapids), "avx512_vnni" (the same without BF16, whose three instructions the build writes
in others: Cascade Lake, Ice Lake), "avx2_vnni" (AVX2 with AVX-VNNI: Intel's Alder Lake and later cores without
AVX-512), "avx2" (AVX2 + FMA + F16C: Haswell and Zen 1 on) and "generic" (torch's own
ops, any CPU). `resolve_isa()` turns the `cpu_isa` setting into one of them, refusing a
variant this CPU cannot execute; forcing a lower one ("avx2" on a Zen 4) runs and tests
that variant's code on a machine that also has the other.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# The x86 features our kernels and torch's fast paths care about, as /proc/cpuinfo names them.
_FEATURES = ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "avx512f", "avx512bw", "avx512cd", "avx512vl",
             "avx512dq", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx_ne_convert", "amx_bf16")

# What each kernel variant's build needs of the CPU (backends/cpu/x86 VARIANTS: x86-64-v4
# plus VNNI, with BF16 or without; x86-64-v3, whose LZCNT /proc/cpuinfo calls "abm", with AVX-VNNI or
# without).
_X86_64_V3 = ("avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")
ISA_NEEDS: dict[str, tuple[str, ...]] = {
    "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
    "avx512_vnni": ("avx512f", "avx512bw", "avx512cd", "avx512vl", "avx512dq", "avx512_vnni"),
    "avx2_vnni": (*_X86_64_V3, "avx_vnni"),
    "avx2": _X86_64_V3,
    "generic": (),
}
CPU_ISAS = ("auto", *ISA_NEEDS)


@dataclass(frozen=True)
class CpuInfo:
    model_name: str
    # The _FEATURES this CPU has.
    flags: frozenset[str]
    # oneDNN can run bfloat16 matmuls and prepack bf16 weights (AVX-512 BW/VL/DQ or
    # AVX-NE-CONVERT): what the torch fallback's bf16 layers need.
    onednn_bf16: bool

    @property
    def isas(self) -> tuple[str, ...]:
        """Kernel variants this CPU executes, best first ("generic" always)."""
        return tuple(isa for isa, needs in ISA_NEEDS.items() if all(f in self.flags for f in needs))

    @property
    def best_isa(self) -> str:
        return self.isas[0]

    def describe(self) -> str:
        shown = [f for f in ("avx512_bf16", "avx512_vnni", "avx512f", "avx_vnni", "avx2", "fma") if f in self.flags]
        return f"{self.model_name or 'this CPU'} ({', '.join(shown) or 'no AVX2'})"

    def resolve_isa(self, requested: str = "auto") -> str:
        """The kernel variant to run for the `cpu_isa` setting; ValueError for a variant
        this CPU cannot execute."""
        if requested not in CPU_ISAS:
            raise ValueError(f"cpu_isa must be one of {', '.join(CPU_ISAS)}; got {requested!r}")
        if requested == "auto":
            return self.best_isa
        if requested not in self.isas:
            missing = [f for f in ISA_NEEDS[requested] if f not in self.flags]
            raise ValueError(f"cpu_isa={requested!r} needs {', '.join(missing)}, which {self.describe()} lacks; "
                             f"what runs here: {', '.join(self.isas)}")
        return requested


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


def _onednn_bf16() -> bool:
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def cpu() -> CpuInfo:
    name, flags = _read_cpuinfo()
    return CpuInfo(name, frozenset(f for f in _FEATURES if f in flags), _onednn_bf16())
