"""Linear layers with the fastest weight form the device offers.

`Linear` is an nn.Linear that can be switched, after loading, to
- a oneDNN prepacked bf16 weight on CPU (the op inductor's freezing uses; measured
  1.3-1.5x faster than F.linear at batch 1-32, bitwise equal here);
- int8 weight-only quantization (`quantize_int8`): symmetric per-output-channel scales.
  Rows of a step at most INT8_MAX_ROWS use torch's int8 weight-pack matmul, which reads
  half the bytes (the single-stream case is memory-bound); bigger batches use the
  dequantized weight through the packed bf16 path, so every row sees the same int8 weights.
- a batch-invariant kernel (deterministic mode, `enable_batch_invariant`): worker/kernels'
  bi_linear, whose every output is reduced over K in one fixed order whatever the row count.
Numerics are unchanged where none is used: float32 and GPU keep plain F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


# Measured crossover on a 2-core AVX-512 CPU: int8 matmul wins at 1-2 rows, loses beyond.
INT8_MAX_ROWS = 2


class Linear(nn.Linear):
    packed: torch.Tensor | None = None
    qweight: torch.Tensor | None = None   # int8 [out, in]
    qscale: torch.Tensor | None = None    # [out], in the activation dtype
    bi_kernels: object | None = None      # deterministic mode: the kernel module ...
    bi_packed: torch.Tensor | None = None  # ... and the weight packed for it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bi_packed is not None:
            return self.bi_kernels.bi_linear(x, self.bi_packed, self.out_features, self.bias)
        if self.qweight is not None and x.shape[0] <= INT8_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.qscale)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def can_prepack(device: torch.device, dtype: torch.dtype) -> bool:
    return (device.type == "cpu" and dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


@torch.no_grad()
def prepack_linears(model: nn.Module) -> int:
    """Give every Linear a prepacked weight; returns how many were packed."""
    n = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
            n += 1
    return n


@torch.no_grad()
def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: w ~= q * scale, |q| <= 127."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@torch.no_grad()
def quantize_int8(model: nn.Module, dtype: torch.dtype) -> int:
    """Quantize every Linear's weight to int8 in place (the float weight becomes its
    dequantized value); returns how many layers."""
    n = 0
    for module in model.modules():
        if isinstance(module, Linear):
            q, scale = quantize_per_channel(module.weight)
            module.qweight, module.qscale = q, scale.to(dtype)
            module.weight.copy_((q.float() * scale[:, None]).to(module.weight.dtype))
            n += 1
    return n


@torch.no_grad()
def enable_batch_invariant_linears(model: nn.Module, kernels) -> int:
    """Route every Linear through the batch-invariant kernel (deterministic mode). An int8
    model keeps its dequantized weights, so both modes see the same weight values."""
    n = 0
    for module in model.modules():
        if isinstance(module, Linear):
            module.bi_kernels, module.bi_packed = kernels, kernels.bi_pack_weight(module.weight.detach())
            module.packed = module.qweight = module.qscale = None
            n += 1
    return n
