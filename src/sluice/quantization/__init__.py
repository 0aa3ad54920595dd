"""Quantization schemes, registered by name once: every other place (the settings, the
CLI, backends/select.py's refusals, the backends' set-up) asks this registry.

int8 (weight-only int8), w8a8 (int8 weights by int8 activations), w4a8 (Q4_1's 4-bit
weights by int8 activations), gguf (a GGUF's own quantized blocks by int8 activations) on
the CPU kernels; fp8 (e4m3 weights by FP8 activations) on CUDA; each in its own file (base.py says what a scheme is).
"""
from __future__ import annotations

from sluice.quantization.base import QuantizationScheme
from sluice.quantization.fp8 import FP8_SCHEME
from sluice.quantization.gguf import GGUF_SCHEME
from sluice.quantization.int8 import INT8
from sluice.quantization.w4a8 import W4A8_SCHEME
from sluice.quantization.w8a8 import W8A8_SCHEME

SCHEMES: dict[str, QuantizationScheme] = {s.name: s for s in (INT8, W8A8_SCHEME, W4A8_SCHEME, GGUF_SCHEME, FP8_SCHEME)}
NAMES = tuple(SCHEMES)


def get(name: str | None) -> QuantizationScheme | None:
    """The scheme of that name (None for None); ValueError for an unknown name."""
    if name is None:
        return None
    if name not in SCHEMES:
        raise ValueError(f"quantization must be None or one of {', '.join(map(repr, NAMES))}, got {name!r}")
    return SCHEMES[name]
