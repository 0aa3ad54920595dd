"""The per-layer ops a model calls that are not linear layers: RMSNorm (alone and fused
with the residual add), SwiGLU, and RoPE with the KV-cache write.

`TorchOps` is torch's own ops, the reference numerics (the float32 exact-match tests run
on them); `KernelOps` runs the same ops on our C++ kernels, each output computed in one
order whatever the batch. Models hold one of them as `ops` (backends/prepare.py sets it)
and call it without knowing which.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from sluice.worker.attention import write_kv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class TorchOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x.to(dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(RMSNorm(x + residual), x + residual)."""
        s = residual + x
        return self.rms_norm(s, weight, eps), s

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_write_kv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: tuple[torch.Tensor, torch.Tensor], slot_mapping: torch.Tensor, num_heads: int,
                      num_kv_heads: int, head_dim: int, q_norm=None, k_norm=None) -> torch.Tensor:
        """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] after RoPE; K (after RoPE) and V go into
        the cache at the slots. q_norm / k_norm: per-head RMSNorm before RoPE (Qwen3)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
        q = q.view(T, num_heads, head_dim)
        k = k.view(T, num_kv_heads, head_dim)
        v = v.view(T, num_kv_heads, head_dim)
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        write_kv(kv_cache[0], kv_cache[1], k, v, slot_mapping)
        return q


class KernelOps(TorchOps):
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


TORCH_OPS = TorchOps()
