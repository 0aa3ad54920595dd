"""FP8 (e4m3) on the CUDA backend: the rounding every FP8 write uses, activations quantized
per token in one Triton pass, and the linear method of an FP8 layer.

e4m3 ("float8_e4m3fn"): 4 exponent and 3 mantissa bits, largest finite value 448, no
infinities. A value is stored as q = e4m3(x / scale) with a float32 scale chosen so the
largest |x| of its group (an output channel of a weight, a token's activations, a token's
K or V of one head) maps to 448.

`e4m3_round` rounds float32 to the nearest e4m3 value (half to even, subnormals
included) with integer and float32 operations only, so that the conversion to fp8 that
follows is exact: Triton's interpreter converts to fp8 with its own (wrong) rounding, and
this way a kernel writes the same bits on a GPU, under the interpreter and as torch's
`.to(torch.float8_e4m3fn)` does.

`Fp8Linear`: y = x @ (q * scale)^T. At a few rows (where the calibration measured it
faster) the split-K GEMV (gemv.py) reads the FP8 weights and keeps bf16 activations; above
that the activations are quantized per token and the product is `torch._scaled_mm`
(FP8 tensor cores: 19 µs against int8's 133 µs on a 32 x 4096 x 14336 product on the
H200), with the GEMV kernel for shapes _scaled_mm does not take.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.backends.cuda.gemv import GemvChoice, GemvConfig, default_config, gemv
from sluice.quantization.fp8 import E4M3_MAX, FP8, check_scales, quantize_rows_reference  # noqa: F401


@triton.jit
def e4m3_round(x):
    """float32 in [-448, 448] -> the nearest e4m3 value (half to even), still float32:
    adding 2^(e + 20) (e the value's exponent, at least -6: e4m3's subnormals) leaves
    exactly e4m3's 3 mantissa bits in a float32 add, which rounds half to even."""
    a = tl.abs(x)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    magic = ((e + 147) << 23).to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    return tl.where(x < 0, -r, r)


@triton.jit
def _quantize_rows_kernel(X, Q, S, K, stride_x, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    amax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(X + row * stride_x + start + i, mask=start + i < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    top = tl.maximum(tl.max(amax, 0), 1e-12)
    inv = 448.0 / top
    for start in range(0, K, BLOCK):
        ok = start + i < K
        x = tl.load(X + row * stride_x + start + i, mask=ok, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(Q + row * stride_q + start + i, e4m3_round(y).to(Q.dtype.element_ty), mask=ok)
    tl.store(S + row, top / 448.0)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M]) in one pass a row (Triton): a token's
    activations for torch._scaled_mm."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m,), dtype=torch.float32, device=x.device)
    if m:
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), q.stride(0), BLOCK=min(4096, triton.next_power_of_2(k)))
    return q, s


@dataclass
class Fp8Linear:
    """An FP8 layer's method: e4m3 weight [N, K] with a float32 scale per output channel."""
    weight: torch.Tensor
    scale: torch.Tensor
    # Per row bucket, the GEMV configuration measured faster than _scaled_mm (gemv.py);
    # None: the GEMV at every row count up to GEMV_MAX_ROWS (under the interpreter).
    gemv_choice: GemvChoice | None = None
    gemv_max_rows: int = 8

    def scaled_mm_ok(self, x: torch.Tensor) -> bool:
        """torch._scaled_mm's row-wise scaling: bf16 out, K and N multiples of 16."""
        n, k = self.weight.shape
        return x.dtype == torch.bfloat16 and k % 16 == 0 and n % 16 == 0

    def gemv_config(self, rows: int) -> GemvConfig | None:
        """The GEMV's configuration for a step of `rows` rows, or None: the other path."""
        if rows > self.gemv_max_rows:
            return None
        if self.gemv_choice is None:
            n, k = self.weight.shape
            return default_config(n, k, self.weight.dtype)
        return self.gemv_choice.pick(rows)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        rows = x2.shape[0]
        cfg = self.gemv_config(rows)
        if cfg is None and self.scaled_mm_ok(x2):
            q, s = quantize_rows(x2)
            y = torch._scaled_mm(q, self.weight.t(), scale_a=s[:, None], scale_b=self.scale[None, :],
                                 out_dtype=x2.dtype)
            if bias is not None:
                y = y + bias
        else:
            y = gemv(x2, self.weight, self.scale, bias, cfg)
        return y.view(*shape[:-1], y.shape[-1])


@dataclass
class GemvLinear:
    """A bf16 / fp16 layer's method where the calibration measured the GEMV faster than
    cuBLAS at some row counts: those steps run it, the others F.linear."""
    weight: torch.Tensor
    gemv_choice: GemvChoice

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        cfg = self.gemv_choice.pick(x2.shape[0]) if x2.stride(-1) == 1 else None
        if cfg is None:
            return torch.nn.functional.linear(x, self.weight, bias)
        y = gemv(x2, self.weight, None, bias, cfg)
        return y.view(*shape[:-1], y.shape[-1])
