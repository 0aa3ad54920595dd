"""RMSNorm (alone and fused with the residual add) and SwiGLU in Triton: one pass over a
row each, float32 inside, where torch would run three to five kernels and round between
them. One program per row; rows up to 64K features."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, R, W, Out, Sum, stride_x, stride_r, stride_o, stride_s, n, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    ok = i < n
    # Arithmetic in float32, rounded where torch's ops round (every op of a bf16 tensor
    # computes in float32 and rounds its result), so the results are torch's to the bit
    # where the sums are (the interpreter has no bf16 arithmetic of its own either).
    x = tl.load(X + row * stride_x + i, mask=ok, other=0.0)
    if HAS_RES:
        # The sum in the model's dtype, as torch's residual + x: it is the next residual.
        r = tl.load(R + row * stride_r + i, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Sum + row * stride_s + i, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(W + i, mask=ok, other=0.0).to(tl.float32)
    # As TorchOps.rms_norm: normalised in float32, rounded to the model's dtype, times the weight.
    y = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + i, (w * y).to(Out.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.stride(0), x2.stride(0), out.stride(0),
                                         out.stride(0), x2.shape[1], eps, HAS_RES=False,
                                         BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(*x.shape[:-1], x.shape[-1])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(x + residual), x + residual)."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x2)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, total, x2.stride(0), r2.stride(0), out.stride(0),
                                         total.stride(0), x2.shape[1], eps, HAS_RES=True,
                                         BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape), total.view(x.shape)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_g, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < n
    g = tl.load(GU + row * stride_g + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_g + n + col, mask=ok, other=0.0)
    # silu in float32, rounded to the model's dtype, times up (torch's F.silu(gate) * up).
    s = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + col, (s * u.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g2 = _rows(gate_up)
    n = g2.shape[1] // 2
    out = torch.empty((g2.shape[0], n), dtype=gate_up.dtype, device=gate_up.device)
    if g2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul_kernel[(g2.shape[0], triton.cdiv(n, block))](g2, out, g2.stride(0), out.stride(0), n, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)
