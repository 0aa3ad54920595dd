"""Linear methods: the forms a Linear layer's weight can take and how each multiplies.

A method is a callable `method(x, bias)` that a `models.linear.Linear` runs in place of
F.linear once the backend (backends/prepare.py) has set it; backends/select.py names the
method for the model (LINEAR_METHODS):
- `kernels*`: our C++ kernels (worker/kernels, AVX-512 or AVX2 build; `KernelWeight`): each
  output reduced over K in one fixed order whatever the number of rows, which makes them
  batch-invariant (deterministic mode) and, at decode batch sizes, faster than oneDNN
  (measured 1.1-2.4x at 1-32 rows, equal at 2,048). With int8 weights, steps of at most
  KERNEL_INT8_MAX_ROWS rows read the int8 weights (half the bytes; decode at small batch
  is memory-bound) and bigger ones the dequantized bf16 weights; deterministic mode reads
  the int8 weights at every size, so a row never changes kernel with the batch; w8a8
  multiplies the same int8 weights by activations quantized to int8 per block of 32
  inside the kernel (worker/kernels/w8a8.cpp), at every row count; w4a8 multiplies 4-bit
  weights (`quantize_rows_4bit`: Q4_1's form, a scale and a minimum per block of 32) by
  the same int8 activations (worker/kernels/w4a8.cpp), at every row count;
- `onednn-bf16`: a oneDNN prepacked bf16 weight (`PackedWeight`), where our kernels do not
  run the model (the op inductor's freezing uses);
- `torch-int8`: int8 weight-only quantization (`quantize_rows`, symmetric per-output-channel
  scales; `Int8Weight`): rows of a step at most INT8_MAX_ROWS use torch's int8 matmul,
  more rows the dequantized weight.
Numerics are unchanged where none is set: float32 and GPU keep plain F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.models.linear import Linear


# Measured crossovers on a 2-core AVX-512 CPU: torch's int8 matmul wins at 1-2 rows;
# our int8 kernel at up to ~8 (30 layers: 4.6 vs 7.5 ms at 1 row, 5.1 vs 7.4 at 4, slower at 16).
INT8_MAX_ROWS = 2
KERNEL_INT8_MAX_ROWS = 8


@dataclass
class KernelWeight:
    """One weight matrix packed for the C++ kernels, and how to multiply by it."""
    kernels: object
    n: int                               # output features
    packed: torch.Tensor | None          # bf16/fp32, for kernels.bi_linear
    q_packed: torch.Tensor | None = None  # int8, for kernels.bi_linear_int8 ...
    qscale: torch.Tensor | None = None   # ... with its per-column float32 scales
    int8_max_rows: float = 0
    w8a8: torch.Tensor | None = None     # int8 for kernels.w8a8_linear, with qscale
    w4a8: torch.Tensor | None = None     # 4-bit for kernels.w4a8_linear ...
    w4d: torch.Tensor | None = None      # ... with its block scales
    w4m: torch.Tensor | None = None      # ... and block minimums
    # float32 outputs by default: the LM head's logits, a row-parallel layer's partial sums
    out_float32: bool = False

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_float32: bool | None = None):
        out_float32 = self.out_float32 if out_float32 is None else out_float32
        if self.w4a8 is not None:
            return self.kernels.w4a8_linear(x, self.w4a8, self.w4d, self.w4m, self.n, bias, out_float32)
        if self.w8a8 is not None:
            return self.kernels.w8a8_linear(x, self.w8a8, self.qscale, self.n, bias, out_float32)
        if self.q_packed is not None and x.shape[0] <= self.int8_max_rows:
            return self.kernels.bi_linear_int8(x, self.q_packed, self.qscale, self.n, bias, out_float32)
        return self.kernels.bi_linear(x, self.packed, self.n, bias, out_float32)


def kernel_weight(kernels, weight: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor] | None,
                  deterministic: bool, w8a8: bool = False,
                  w4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> KernelWeight:
    weight = weight.detach()
    if w4 is not None:  # one kernel at every row count, so batch-invariant whatever the mode
        packed, d, m = kernels.w4a8_pack_weight(*w4)
        return KernelWeight(kernels, weight.shape[0], None, w4a8=packed, w4d=d, w4m=m)
    if q is None:
        return KernelWeight(kernels, weight.shape[0], kernels.bi_pack_weight(weight))
    qweight, qscale = q
    if w8a8:  # one kernel at every row count, so batch-invariant whatever the mode
        return KernelWeight(kernels, weight.shape[0], None, qscale=qscale.float().contiguous(),
                            w8a8=kernels.w8a8_pack_weight(qweight))
    return KernelWeight(kernels, weight.shape[0],
                        None if deterministic else kernels.bi_pack_weight(weight),
                        kernels.bi_pack_weight_int8(qweight), qscale.float().contiguous(),
                        float("inf") if deterministic else KERNEL_INT8_MAX_ROWS)


@dataclass
class PackedWeight:
    """A oneDNN prepacked bf16 weight."""
    packed: torch.Tensor

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


@dataclass
class Int8Weight:
    """int8 weights with per-row scales: torch's int8 matmul for steps of at most
    INT8_MAX_ROWS rows, the dequantized weight (prepacked where oneDNN can) above."""
    qweight: torch.Tensor                 # int8 [out, in]
    qscale: torch.Tensor                  # [out], in the activation dtype
    weight: torch.Tensor                  # the dequantized weight
    packed: PackedWeight | None = None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] <= INT8_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.qscale)
            return y if bias is None else y + bias
        if self.packed is not None:
            return self.packed(x, bias)
        return F.linear(x, self.weight, bias)


@torch.no_grad()
def prepack_weight(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def quantize_per_channel(weight: torch.Tensor, reduce=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: w ~= q * scale, |q| <= 127. reduce: a row-parallel
    layer's tensor-parallel group, whose ranks each hold a slice of every row: the scale is
    the whole row's (its largest value over the ranks), as one process would compute it."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    if reduce is not None:
        reduce.all_reduce(amax, op="max")
    scale = (amax / 127.0).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
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


BLOCK_4BIT = 32


def quantize_4bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 per block of 32 k of each row: w ~= d * q + m with q in 0..15, m
    the block's minimum and d = (max - m) / 15. Returns (q [N, K] uint8, d, m [N, ceil(K /
    32)] float32). On the values of a Q4_1 tensor (a Q4_1 GGUF loaded in bf16) it finds
    the stored q again: each value is within bf16 rounding of d * q + m, far under d / 2."""
    w = weight.detach().float()
    n, k = w.shape
    kp = -(-k // BLOCK_4BIT) * BLOCK_4BIT
    valid = torch.arange(kp) < k
    wp = torch.nn.functional.pad(w, (0, kp - k)).view(n, kp // BLOCK_4BIT, BLOCK_4BIT)
    valid = valid.view(1, kp // BLOCK_4BIT, BLOCK_4BIT)
    mn = torch.where(valid, wp, torch.inf).amin(dim=2)
    mx = torch.where(valid, wp, -torch.inf).amax(dim=2)
    d = (mx - mn) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((wp - mn[..., None]) / safe[..., None]).clamp(0, 15)
    q = torch.where(valid & (d[..., None] > 0), q, torch.zeros_like(q))
    return q.view(n, kp)[:, :k].to(torch.uint8).contiguous(), d, mn


def dequantize_4bit(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """quantize_4bit's values back: d * q + m per block of 32, float32 [N, K]."""
    n, k = q.shape
    nblk = d.shape[1]
    qb = torch.nn.functional.pad(q.float(), (0, nblk * BLOCK_4BIT - k)).view(n, nblk, BLOCK_4BIT)
    return (qb * d[..., None] + m[..., None]).view(n, -1)[:, :k]


@torch.no_grad()
def quantize_rows_4bit(module: Linear, start: int = 0, rows: int | None = None) -> None:
    """quantize_rows' 4-bit counterpart: rows [start, start + rows) of a Linear's weight to
    quantize_4bit's form, in place (the weight keeps their dequantized values), and
    `module.w4` their (q, d, m), what the w4a8 kernels pack. Rows are independent."""
    rows = module.weight.shape[0] - start if rows is None else rows
    w = module.weight.narrow(0, start, rows)
    q, d, m = quantize_4bit(w)
    w.copy_(dequantize_4bit(q, d, m).to(w.dtype))
    if getattr(module, "w4", None) is None:
        full, nblk = module.weight.shape, d.shape[1]
        module.w4 = (torch.zeros(full, dtype=torch.uint8), torch.zeros(full[0], nblk), torch.zeros(full[0], nblk))
    for held, new in zip(module.w4, (q, d, m)):
        held[start:start + rows] = new


# How each quantization scheme quantizes rows [start, start + rows) of a Linear in place,
# at load and after a weight update (backends/prepare.py).
ROW_QUANTIZERS = {"int8": quantize_rows, "w8a8": quantize_rows, "w4a8": quantize_rows_4bit}


def int8_weight(module: Linear, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized Linear's int8 weights and per-row scales (in `dtype`), read back from
    its dequantized weight: exactly the int8 values quantize_rows computed, since a bf16
    product q * scale is within 2^-8 of its value, so |q| <= 127 is off by under 0.5."""
    scale = module.int8_scale
    q = torch.round(module.weight.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(dtype)
