"""w8a8: the int8 weights of `int8` times activations quantized to int8 per block of 32
inside the kernel (backends/cpu/x86/w8a8.cpp), at every row count (so batch-invariant
whatever the mode): faster where a step is bound by arithmetic (batches, prompts) on CPUs
with VNNI. The end layers keep bf16 activations by the int8 weights (base.end_layers)."""
from __future__ import annotations

from sluice.quantization.base import QuantizationScheme, end_layers
from sluice.quantization.int8 import int8_weight, quantize_rows


class W8A8(QuantizationScheme):
    name = "w8a8"

    def quantize_rows(self, module, start=0, rows=None):
        quantize_rows(module, start, rows)

    def kernel_method(self, kernels, model, name, module, dtype, deterministic):
        from sluice.backends.cpu.linear import kernel_weight
        activations = not name.startswith(end_layers(model))
        return kernel_weight(kernels, module.weight, int8_weight(module, dtype), deterministic, w8a8=activations)


W8A8_SCHEME = W8A8()
