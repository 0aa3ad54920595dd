"""A small-batch matrix product in Triton: y = x @ W^T (times a scale per output channel,
plus a bias) for steps of a few rows, over bf16 / fp16 / float32 or FP8 (e4m3) weights.

At 1-8 rows a decode step's linear layers are bound by reading their weights, and what
decides the time is how much of the GPU reads at once: cuBLAS picks its tiles for the
general case and reaches ~79% of the H200's bandwidth on an 8B model's layers at one row
(../shared/gpu.md). This kernel is split-K: the grid is (row tiles, column tiles, splits of
K), so a 4096-column layer still has a few hundred programs in flight, each streaming its
[BLOCK_N x BLOCK_K] tiles of W along K with 16-byte loads; partial sums of the splits go
to a float32 buffer and a second kernel adds them in a fixed order (no atomics: the same
bits every run) and applies the scale, the bias and the rounding once.

The product of a tile is tl.dot over 16 padded rows (a tensor-core op even at one row:
compute is free here, the loads are what count). FP8 weights are widened to the
activations' dtype in registers (exact: e4m3 values are bf16 values), so an FP8 layer at
few rows reads 1 byte a weight and keeps bf16 activations.

Which configuration runs, and whether this kernel runs at all instead of cuBLAS, is
measured on the GPU for each layer shape and row bucket when the model is prepared
(`calibrate`): the backend picks it by row count only where it was faster there. Under
Triton's interpreter (CI) it runs wherever it is asked to, on CPU tensors, with products
in float32 (the interpreter has no half-precision arithmetic).
"""
from __future__ import annotations

import logging
import os
import statistics
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

logger = logging.getLogger("sluice.backends.select")

# The most rows a step may have for the GEMV to be considered (above: cuBLAS's GEMM).
GEMV_MAX_ROWS = 8
# The row buckets the calibration measures; a step's row count uses the next bucket up.
ROW_BUCKETS = (1, 2, 4, 8)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def describe(self) -> str:
        return f"n{self.block_n}k{self.block_k}s{self.split}"


def ieee_products(dtype: torch.dtype) -> bool:
    """Products in float32 (IEEE, not TF32): for float32 inputs, and for every input under
    Triton's interpreter, which has no bf16 or fp16 arithmetic of its own (its bf16 dot
    products come out as garbage), so there the half-precision kernels run upcast."""
    return dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _gemv_kernel(X, W, Scale, Bias, Out, Part, M, N, K, k_per_split,
                 stride_xm, stride_wn, stride_om, stride_ps, stride_pm,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                 HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    # SPLIT: whether K is split (partial sums to Part), not how many ways: one compile for
    # every split count.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    m_ok = m < M
    n_ok = n < N
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for start in range(k_lo, k_hi, BLOCK_K):
        k = start + kk
        k_ok = k < k_hi
        x = tl.load(X + m[:, None] * stride_xm + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + n[:, None] * stride_wn + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if not SPLIT:
        if HAS_SCALE:
            acc = acc * tl.load(Scale + n, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(Bias + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + m[:, None] * stride_om + n[None, :], acc.to(Out.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        tl.store(Part + pid_k * stride_ps + m[:, None] * stride_pm + n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _splitk_reduce_kernel(Part, Scale, Bias, Out, N, stride_ps, stride_pm, stride_om,
                          SPLIT: tl.constexpr, BLOCK: tl.constexpr, HAS_SCALE: tl.constexpr,
                          HAS_BIAS: tl.constexpr):
    row = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = n < N
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: the same bits every run
        acc += tl.load(Part + s * stride_ps + row * stride_pm + n, mask=ok, other=0.0)
    if HAS_SCALE:
        acc = acc * tl.load(Scale + n, mask=ok, other=0.0)
    if HAS_BIAS:
        acc = acc + tl.load(Bias + n, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_om + n, acc.to(Out.dtype.element_ty), mask=ok)


def default_config(n: int, k: int, weight_dtype: torch.dtype, sms: int = 132) -> GemvConfig:
    """A configuration that keeps a few programs per SM busy: 64 columns a program, K cut
    into as many splits as that takes (at least four tiles of K each)."""
    block_k = 256 if weight_dtype.itemsize == 1 else 128
    block_n = 64
    tiles_n = triton.cdiv(n, block_n)
    split = 1
    while tiles_n * split < 2 * sms and k // (split * 2) >= 4 * block_k:
        split *= 2
    return GemvConfig(block_n=block_n, block_k=block_k, split=split)


def candidates(n: int, k: int, weight_dtype: torch.dtype, sms: int) -> list[GemvConfig]:
    """The configurations the calibration times for one layer shape."""
    base = default_config(n, k, weight_dtype, sms)
    out = {base}
    for block_n in (32, 64, 128):
        for split in (base.split // 2, base.split, base.split * 2):
            if split >= 1 and k // split >= base.block_k:
                out.add(GemvConfig(block_n=block_n, block_k=base.block_k, split=split))
    return sorted(out, key=lambda c: (c.block_n, c.split))


def gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (rows contiguous along K) times weight [N, K]^T, times scale [N] (float32;
    FP8 weights' per-channel scale), plus bias [N] -> [M, N] in x's dtype. Any M works;
    the kernel is meant for few rows."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"gemv takes x [M, K] and weight [N, K] contiguous along K; got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    cfg = config or default_config(n, k, weight.dtype)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device) if out is None else out
    if m == 0:
        return out
    block_m = 16
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    part = (torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1
            else out)  # unused when there is one split
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, cfg.block_n), split)
    ieee = ieee_products(x.dtype)
    _gemv_kernel[grid](x, weight, scale if scale is not None else out, bias if bias is not None else out, out, part,
                       m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(0),
                       part.stride(0) if split > 1 else 0, part.stride(1) if split > 1 else 0,
                       BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1,
                       HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, IEEE=ieee,
                       num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _splitk_reduce_kernel[(m, triton.cdiv(n, block))](
            part, scale if scale is not None else out, bias if bias is not None else out, out, n, part.stride(0),
            part.stride(1), out.stride(0), SPLIT=split, BLOCK=block, HAS_SCALE=scale is not None,
            HAS_BIAS=bias is not None)
    return out


def row_bucket(rows: int) -> int | None:
    """The calibration bucket a step of `rows` rows uses; None above GEMV_MAX_ROWS."""
    for b in ROW_BUCKETS:
        if rows <= b:
            return b
    return None


@dataclass
class GemvChoice:
    """Per row bucket, the GEMV configuration that beat the other path on this layer's
    shape (absent: the other path), with the measured times for the log."""
    configs: dict[int, GemvConfig]
    times: dict[int, tuple[float, float]]  # bucket -> (best GEMV µs, other path µs)

    def pick(self, rows: int) -> GemvConfig | None:
        b = row_bucket(rows)
        return None if b is None else self.configs.get(b)


def time_us(fn, rows: int, cfg: GemvConfig | None, reps: int = 25) -> float:
    """Median microseconds of fn() (the GEMV with `cfg` at `rows` rows, or the other path
    for cfg None): CUDA events on the current stream on a GPU."""
    import time
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


@torch.no_grad()
def calibrate(weight: torch.Tensor, scale: torch.Tensor | None, other, act_dtype: torch.dtype,
              timer=time_us) -> GemvChoice:
    """On the GPU: for each row bucket, the fastest GEMV configuration against `other(x)`
    (cuBLAS's product for the same layer), kept only where it wins. The weight's own
    tensors are used (a layer of an 8B model is tens of MB: far past L2, as in a step).
    timer(fn, rows, cfg) -> µs (the tests give their own)."""
    n, k = weight.shape
    sms = (torch.cuda.get_device_properties(weight.device).multi_processor_count if weight.device.type == "cuda"
           else 132)
    configs, times = {}, {}
    for rows in ROW_BUCKETS:
        x = torch.randn((rows, k), dtype=act_dtype, device=weight.device)
        base = timer(lambda: other(x), rows, None)
        best, best_t = None, float("inf")
        for cfg in candidates(n, k, weight.dtype, sms):
            try:
                t = timer(lambda: gemv(x, weight, scale, None, cfg), rows, cfg)
            except Exception as e:  # a configuration this GPU cannot compile: not a candidate
                logger.debug("gemv %s on %dx%d: %s", cfg.describe(), n, k, e)
                continue
            if t < best_t:
                best, best_t = cfg, t
        times[rows] = (best_t, base)
        if best is not None and best_t < base:
            configs[rows] = best
    return GemvChoice(configs, times)
