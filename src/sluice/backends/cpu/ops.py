"""The CPU backend's layer ops: our C++ kernels (backends/cpu/x86) where they run the
model, torch's (backends/torch_ref.py) elsewhere.

`KernelOps` runs RMSNorm, SwiGLU, RoPE with the K/V cache write and attention on the
kernels, each output computed in one order whatever the batch (bf16, and deterministic
mode in float32 too). `DecodeKernelOps` keeps torch's norms and RoPE (float32's reference
numerics) and sends decode rows through the C++ decode kernel. Attention follows the
step's record (`paged_attention`): one paged_attention_varlen call for every token where
the backend made the step flat (`meta.flat_kernel`), else the decode kernel for decode
rows where it is built, torch's matmuls otherwise, and SDPA per prompt chunk.
"""
from __future__ import annotations

import torch

from sluice.backends.torch_ref import TorchOps, decode_attention, prefill_attention


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                    window: int = 0) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], attending over each request's cached K/V (its last
    `window` positions where window > 0: a sliding-window layer; the decode-only kernel
    takes no window, torch's masked matmuls run those rows then)."""
    if meta.flat_kernel is not None:  # padding rows come out as zeros
        return meta.flat_kernel.paged_attention_varlen(q.contiguous(), k_cache, v_cache, meta.block_tables,
                                                       meta.query_start_loc, meta.seq_lens, scale, window)
    # Zeros, not empty: rows that pad a bucketed batch are attended by nobody and must stay finite.
    out = torch.zeros_like(q)
    if meta.decode_token_idx is not None and meta.decode_kernel is not None and not window:
        qd = q.index_select(0, meta.decode_token_idx)
        od = meta.decode_kernel.paged_decode_attention(qd, k_cache, v_cache, meta.decode_block_tables,
                                                       meta.decode_seq_lens, scale)
        out.index_copy_(0, meta.decode_token_idx, od)
    elif meta.decode_token_idx is not None:
        decode_attention(q, k_cache, v_cache, meta, scale, out, window)
    prefill_attention(q, k_cache, v_cache, meta, scale, out, window)
    return out


class DecodeKernelOps(TorchOps):
    name = "kernels-decode"

    def attention(self, q, k_cache, v_cache, meta, scale, window=0):
        return paged_attention(q, k_cache, v_cache, meta, scale, window)


class KernelOps(DecodeKernelOps):
    name = "kernels"

    def __init__(self, kernels):
        self.kernels = kernels

    def rms_norm(self, x, weight, eps):
        return self.kernels.bi_rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.bi_add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        return self.kernels.bi_silu_and_mul(gate_up)

    def rope_write_kv(self, qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm=None,
                      k_norm=None):
        if q_norm is not None:  # per-head norms between the split and RoPE: torch's path, our norms
            return super().rope_write_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                                         q_norm, k_norm)
        # One C++ pass for RoPE and the cache write (some twenty torch ops otherwise).
        return self.kernels.rope_write_kv(qkv, cos, sin, kv_cache[0], kv_cache[1], slot_mapping, num_heads,
                                          num_kv_heads)
