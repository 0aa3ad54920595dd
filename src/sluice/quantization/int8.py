"""int8: weight-only int8 with a symmetric scale per output channel; the activations stay
in the model's dtype. On our kernels, steps of up to 8 rows read the int8 weights (half
the bytes: decode at small batch is memory-bound) and bigger ones the dequantized bf16
weights; deterministic mode reads the int8 weights at every size, so a row never changes
kernel with its batch. On torch's own ops, torch's int8 matmul up to 2 rows."""
from __future__ import annotations

import torch

from sluice.models.linear import Linear
from sluice.quantization.base import QuantizationScheme


# Values per chunk of rows that quantize_per_channel converts to float32 at once (16 MB).
CHUNK_VALUES = 1 << 22


def quantize_per_channel(weight: torch.Tensor, reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: w ~= q * scale, |q| <= 127. reduce: a row-parallel
    layer's tensor-parallel group, whose ranks each hold a slice of every row: the scale is
    the whole row's (its largest value over the ranks), as one process would compute it.

    A chunk of rows at a time in one float32 buffer (rows are independent, and in-place
    operations round as the others do: the same values as in one pass), so that the
    temporaries stay small: in one pass a table of Gemma 3's 168M entries took 2 GB beside
    the 0.2 GB of int8 it made. (Fresh temporaries per chunk peaked nearly as high: glibc
    reused few of the freed ones.)"""
    w = weight.detach()
    rows = w.shape[0]
    step = max(1, min(rows, CHUNK_VALUES // max(1, w.shape[1])))
    buf = torch.empty((step, w.shape[1]), dtype=torch.float32, device=w.device)
    amax = torch.empty(rows, dtype=torch.float32, device=w.device)
    for i in range(0, rows, step):
        b = buf[:min(step, rows - i)]
        torch.amax(b.copy_(w[i:i + step]).abs_(), dim=1, out=amax[i:i + step])
    if reduce is not None:
        reduce.all_reduce(amax, op="max")
    scale = (amax / 127.0).clamp(min=1e-12)
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    for i in range(0, rows, step):
        b = buf[:min(step, rows - i)]
        q[i:i + step] = b.copy_(w[i:i + step]).div_(scale[i:i + step, None]).round_().clamp_(-127, 127)
    return q, scale


@torch.no_grad()
def quantize_rows(module: Linear, start: int = 0, rows: int | None = None) -> None:
    """Quantize rows [start, start + rows) of a Linear's weight (all by default) to int8 in
    place: the weight keeps their dequantized values (what the layer computes with), and
    `module.int8_scale` their float32 scales. Rows are independent (one scale each), so
    requantizing some rows after a weight update gives what quantizing the whole new
    weight would."""
    rows = module.weight.shape[0] - start if rows is None else rows
    w = module.weight.narrow(0, start, rows)
    q, scale = quantize_per_channel(w, module.reduce)
    w.copy_((q.float() * scale[:, None]).to(w.dtype))
    if getattr(module, "int8_scale", None) is None:
        module.int8_scale = torch.empty(module.weight.shape[0], dtype=torch.float32)
    module.int8_scale[start:start + rows] = scale


def int8_weight(module: Linear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized Linear's int8 weights and per-row scales (in `dtype`), read back from
    its dequantized weight: exactly the int8 values quantize_rows computed, since a bf16
    product q * scale is within 2^-8 of its value, so |q| <= 127 is off by under 0.5."""
    scale = module.int8_scale
    q = torch.round(module.weight.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(dtype)


class Int8(QuantizationScheme):
    name = "int8"
    needs_kernels = False

    def quantize_rows(self, module, start=0, rows=None):
        quantize_rows(module, start, rows)

    def kernel_method(self, kernels, model, name, module, dtype, deterministic):
        from sluice.backends.cpu.linear import kernel_weight
        return kernel_weight(kernels, module.weight, int8_weight(module, dtype), deterministic)

    def torch_method(self, module, dtype, packed):
        from sluice.backends.cpu.linear import Int8Weight
        q, scale = int8_weight(module, dtype)
        return Int8Weight(q, scale, module.weight.detach(), packed)


INT8 = Int8()
