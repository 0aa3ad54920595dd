"""RMSNorm (alone and fused with the residual add) and SwiGLU in Triton: one pass over a
row each, float32 inside, where torch would run three to five kernels and round between
them. Rows up to 64K features.

A program takes as many rows as fit a tile of TILE_ELEMENTS values: one row of a 4,096-wide
model, as one program a row would, but four of SmolLM2's 576 (padded to 1,024) and 64 of a
64-wide test model. Small models' steps then launch fewer, fuller programs; under Triton's
interpreter, which runs every op of every program in Python, the suite's steps run several
times faster."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# Values a program holds at once (float32: 16 KB, of registers spread over its warps).
TILE_ELEMENTS = 4096


def rows_per_program(rows: int, width: int, tile: int | None = None) -> int:
    """Rows a program takes: a power of two, whole rows of `width` (a power of two) up to
    `tile` values (TILE_ELEMENTS by default), never more than the rows there are (rounded
    up)."""
    return max(1, min(triton.next_power_of_2(rows), (tile or TILE_ELEMENTS) // width))


@triton.jit
def _rms_norm_kernel(X, R, W, Out, Sum, stride_x, stride_r, stride_o, stride_s, rows, n, eps,
                     HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, BLOCK)
    col_ok = i < n
    ok = (row < rows)[:, None] & col_ok[None, :]
    # Arithmetic in float32, rounded where torch's ops round (every op of a bf16 tensor
    # computes in float32 and rounds its result), so the results are torch's to the bit
    # where the sums are (the interpreter has no bf16 arithmetic of its own either).
    x = tl.load(X + row[:, None] * stride_x + i[None, :], mask=ok, other=0.0)
    if HAS_RES:
        # The sum in the model's dtype, as torch's residual + x: it is the next residual.
        r = tl.load(R + row[:, None] * stride_r + i[None, :], mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Sum + row[:, None] * stride_s + i[None, :], x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / n + eps)
    w = tl.load(W + i, mask=col_ok, other=0.0).to(tl.float32)
    # As TorchOps.rms_norm: normalised in float32, rounded to the model's dtype, times the weight.
    y = (xf * inv[:, None]).to(X.dtype.element_ty).to(tl.float32)
    tl.store(Out + row[:, None] * stride_o + i[None, :], (w[None, :] * y).to(Out.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _norm(x2: torch.Tensor, r2: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, total: torch.Tensor,
          eps: float, has_res: bool) -> None:
    rows, n = x2.shape
    if rows:
        block = triton.next_power_of_2(n)
        per = rows_per_program(rows, block)
        _rms_norm_kernel[(triton.cdiv(rows, per),)](x2, r2, weight, out, total, x2.stride(0), r2.stride(0),
                                                    out.stride(0), total.stride(0), rows, n, eps, HAS_RES=has_res,
                                                    ROWS=per, BLOCK=block)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _norm(x2, x2, weight, out, out, eps, has_res=False)
    return out.view(*x.shape[:-1], x.shape[-1])


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm(x + residual), x + residual)."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    total = torch.empty_like(x2)
    _norm(x2, r2, weight, out, total, eps, has_res=True)
    return out.view(x.shape), total.view(x.shape)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_g, stride_o, rows, n, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = (row < rows)[:, None] & (col < n)[None, :]
    g = tl.load(GU + row[:, None] * stride_g + col[None, :], mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row[:, None] * stride_g + n + col[None, :], mask=ok, other=0.0)
    # silu in float32, rounded to the model's dtype, times up (torch's F.silu(gate) * up).
    s = (g / (1.0 + tl.exp(-g))).to(GU.dtype.element_ty).to(tl.float32)
    tl.store(Out + row[:, None] * stride_o + col[None, :], (s * u.to(tl.float32)).to(Out.dtype.element_ty), mask=ok)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    g2 = _rows(gate_up)
    rows, n = g2.shape[0], g2.shape[1] // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(n))
        per = rows_per_program(rows, block)
        _silu_mul_kernel[(triton.cdiv(rows, per), triton.cdiv(n, block))](g2, out, g2.stride(0), out.stride(0), rows, n,
                                                                          ROWS=per, BLOCK=block)
    return out.view(*gate_up.shape[:-1], n)
