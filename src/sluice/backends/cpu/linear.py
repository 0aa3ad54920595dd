"""How the CPU backend multiplies a Linear layer, by the form its weight takes.

A method is a callable `method(x, bias)` that `models.linear.Linear` runs in place of
F.linear once the backend (backends/cpu/backend.py) has set it:
- `KernelWeight`: our C++ kernels (backends/cpu/x86, AVX-512 or AVX2 build): each output
  reduced over K in one fixed order whatever the number of rows, which makes them
  batch-invariant (deterministic mode) and, at decode batch sizes, faster than oneDNN
  (measured 1.1-2.4x at 1-32 rows, equal at 2,048). Quantized weights (quantization/)
  pack into it too: int8 weights by bf16 activations (up to KERNEL_INT8_MAX_ROWS rows, the
  bf16 weights above; every row count in deterministic mode), int8 weights by int8
  activations per block of 32 (w8a8.cpp), 4-bit weights in Q4_1's form by the same int8
  activations (w4a8.cpp), and a GGUF's own blocks of up to 8 bits in the same form (5-bit
  ones at 5 bits a weight; Q6_K in its own: q6k.cpp, through the same entry points);
- `PackedWeight`: a oneDNN prepacked bf16 weight, where our kernels do not run the model
  (the op inductor's freezing uses);
- `Int8Weight`: int8 weight-only quantization on torch's kernels: rows of a step at most
  INT8_MAX_ROWS use torch's int8 matmul, more rows the dequantized weight.
Numerics are unchanged where none is set: float32 keeps plain F.linear.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sluice.models.linear import release_weight


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
    w4nib: torch.Tensor | None = None    # ... and the weights two to a byte, for steps of few rows
    w4nib_scales: torch.Tensor | None = None  # ... with their own float16 w4d and w4m (stacked), where
    # the byte layout keeps float32 ones (the AVX2 builds) and all are float16 values
    # (Q6_K's form rides in the same fields, told apart by w4m's dtype, int8: w4a8 its low
    # nibbles, w4nib its top bits, w4d its float scale per 256 k, w4m its int8 scales per 16 k)
    # float32 outputs by default: the LM head's logits, a row-parallel layer's partial sums
    out_float32: bool = False

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None, out_float32: bool | None = None):
        out_float32 = self.out_float32 if out_float32 is None else out_float32
        if self.w4a8 is not None:
            return self.kernels.w4a8_linear(x, self.w4a8, self.w4d, self.w4m, self.n, bias, out_float32, self.w4nib,
                                            self.w4nib_scales)
        if self.w8a8 is not None:
            return self.kernels.w8a8_linear(x, self.w8a8, self.qscale, self.n, bias, out_float32)
        if self.q_packed is not None and x.shape[0] <= self.int8_max_rows:
            return self.kernels.bi_linear_int8(x, self.q_packed, self.qscale, self.n, bias, out_float32)
        return self.kernels.bi_linear(x, self.packed, self.n, bias, out_float32)


def kernel_weight(kernels, weight: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor] | None,
                  deterministic: bool, w8a8: bool = False,
                  w4: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                  nibbles_only: bool = False, q6k=None) -> KernelWeight:
    """nibbles_only: 4-bit weights keep only their nibbles, at every row count (half the
    memory on the AVX2 builds, which otherwise keep the byte layout for bigger steps).
    q6k: a Q6_K matrix's blocks (quantization/gguf_blocks.py Q6KBlocks)."""
    weight = weight.detach()
    if q6k is not None:  # one kernel at every row count, so batch-invariant whatever the mode
        low, top, sc, d = kernels.q6k_pack_weight(q6k.q, q6k.sc, q6k.d)
        return KernelWeight(kernels, weight.shape[0], None, w4a8=low, w4d=d, w4m=sc, w4nib=top)
    if w4 is not None:  # one kernel at every row count, so batch-invariant whatever the mode
        if 15 < int(w4[0].max()) <= 31:  # 5-bit blocks (Q5_0, Q5_1, Q5_K): 5 bits a weight, not a byte
            packed, d, m = kernels.w4a8_pack_5bit(*w4)
            return KernelWeight(kernels, weight.shape[0], None, w4a8=packed, w4d=d, w4m=m)
        packed, d, m = kernels.w4a8_pack_weight(*w4)
        if packed.dtype == torch.int8:  # wide weights (up to 254): the byte layout at every row count
            return KernelWeight(kernels, weight.shape[0], None, w4a8=packed, w4d=d, w4m=m)
        nibbles = kernels.w4a8_pack_nibbles(packed)
        # Scales and minimums that are all float16 values (a GGUF's Q4_0 / Q4_1 blocks) read
        # as float16 by the nibbles: 0.625 bytes a weight instead of 0.75, the same values.
        half = kernels.w4a8_half_scales(d, m)
        if nibbles_only or kernels.w4a8_nibble_max_rows() >= 2**62:  # nibbles at every row count
            packed = packed.new_empty(0)
            if half is not None:
                d, m = half
        elif half is not None:  # the byte layout's float32 ones stay, for its bigger steps
            return KernelWeight(kernels, weight.shape[0], None, w4a8=packed, w4d=d, w4m=m, w4nib=nibbles,
                                w4nib_scales=torch.stack(half).contiguous())
        return KernelWeight(kernels, weight.shape[0], None, w4a8=packed, w4d=d, w4m=m, w4nib=nibbles)
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


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """bi_pack_weight's layout back to the [n, k] weight: bf16 [N/16, K/2, 16, 2] (a pair of
    k per 16-column lane), float32 [N/16, K, 16]; the padding dropped."""
    if packed.dim() == 4:
        nb, ks, lanes, per = packed.shape
        return packed.permute(0, 2, 1, 3).reshape(nb * lanes, ks * per)[:n, :k]
    nb, ks, lanes = packed.shape
    return packed.permute(0, 2, 1).reshape(nb * lanes, ks)[:n, :k]


@torch.no_grad()
def release_packed_weight(module, packed=None) -> None:
    """A layer whose method multiplies by its packed copy (KernelWeight.packed) drops the
    weight itself: the same values a second time, 2 bytes a parameter (an 8B model's 16
    GB). New rows (a weight update) restore the weight from the packed copy first and are
    written into it; the backend then packs it and releases it again. packed: where the
    copy is (default: the module's method's)."""
    release_weight(module)
    source = packed or (lambda: module.method.packed)

    def write_rows(start: int, values: torch.Tensor) -> None:
        if module.weight.device.type == "meta":  # the first rows of this update
            restore_packed_weight(module, source())
        module.weight.data[start:start + values.shape[0]] = values

    module.write_rows = write_rows


@torch.no_grad()
def restore_packed_weight(module, packed: torch.Tensor) -> None:
    """The released weight again, from its packed copy."""
    full = unpack_weight(packed, *module.weight.shape).contiguous()
    module.weight = torch.nn.Parameter(full, requires_grad=False)


class PackedRows:
    """An embedding table read from the tied LM head's packed bf16 copy (`method.packed`,
    bi_pack_weight's [V/16, K/2, 16, 2]): the same values, so the table is not kept twice
    (SmolLM2's 57 MB, Gemma 3's 335 MB)."""

    def __init__(self, method, n: int, k: int):
        self.method, self.n, self.k = method, n, k

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.method.kernels.bi_packed_rows(ids.reshape(-1).long(), self.method.packed, self.n, self.k)
        return rows.view(*ids.shape, self.k)
