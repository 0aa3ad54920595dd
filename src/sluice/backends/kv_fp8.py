"""The FP8 KV cache's format (kv_cache_dtype="fp8", the CUDA backend): e4m3 values with a
float32 scale per token and KV head, in one tensor per layer's K and V, so that every
block-level operation (prefix hits, copies, offloading) moves a block's scales with it.

The cache is float8_e4m3fn [Hkv, num_blocks, block_size, D + 4]: the bytes of each block
(one KV head) are block_size float32 scales, one per token, then block_size x D e4m3
values, token by token (x ~ scale * value, scale = max|x| / 448 over the token's D
values). 1 + 4/D bytes a value against bf16's 2: 1.94x the tokens per GiB at D = 128.

The Triton kernels write it (attention.rope_write_kv, with backends/cuda/fp8.e4m3_round)
and read it (the attention kernels scale each key's scores and each value's weight by
its token's scale); these torch functions write the same bytes (the torch path's cache
write, for models whose per-head norms keep RoPE in Python) and read them back (tests).
"""
from __future__ import annotations

import torch

FP8_ROW_EXTRA = 4
E4M3_MAX = 448.0


def quantize_tokens_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (e4m3 [..., D], float32 scales [...]): backends/cuda/fp8's rounding."""
    from sluice.quantization.fp8 import quantize_rows_reference
    return quantize_rows_reference(x)


def _places(cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte offsets (within one head's [num_blocks * block bytes]) of each slot's scale and
    first value."""
    _, _, bs, d4 = cache.shape
    d = d4 - FP8_ROW_EXTRA
    slots = slots.to(torch.long)
    base = (slots // bs) * (bs * d4)
    off = slots % bs
    return base + off * 4, base + bs * 4 + off * d


def write_fp8(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantize x [T, Hkv, D] into the FP8 cache at the slots' places."""
    h, _, _, d4 = cache.shape
    d = d4 - FP8_ROW_EXTRA
    q, scale = quantize_tokens_fp8(x.transpose(0, 1))                  # [h, T, D], [h, T]
    scale_at, data_at = _places(cache, slot_mapping.to(cache.device))
    dev = cache.device
    idx = torch.cat([scale_at[:, None] + torch.arange(4, device=dev), data_at[:, None] + torch.arange(d, device=dev)],
                    dim=1).reshape(-1)
    values = torch.cat([scale.contiguous().view(torch.uint8).reshape(h, -1, 4), q.view(torch.uint8)], dim=-1)
    cache.view(torch.uint8).view(h, -1)[:, idx] = values.reshape(h, -1)


def dense_from_fp8_cache(cache: torch.Tensor) -> torch.Tensor:
    """[Hkv, blocks, bs, D + 4] FP8 cache -> its values [Hkv, blocks, bs, D] in float32."""
    h, nb, bs, d4 = cache.shape
    d = d4 - FP8_ROW_EXTRA
    flat = cache.view(torch.uint8).reshape(h, nb, bs * d4)
    scale = flat[..., :bs * 4].contiguous().view(torch.float32)           # [h, nb, bs]
    values = flat[..., bs * 4:].contiguous().view(torch.float8_e4m3fn).reshape(h, nb, bs, d)
    return values.float() * scale[..., None]


def fp8_cache_from_dense(dense: torch.Tensor) -> torch.Tensor:
    """[Hkv, blocks, bs, D] values -> the FP8 cache holding them (tests)."""
    h, nb, bs, d = dense.shape
    q, scale = quantize_tokens_fp8(dense)
    scales = scale.contiguous().view(torch.uint8).reshape(h, nb, bs * 4)
    data = q.view(torch.uint8).reshape(h, nb, bs * d)
    return torch.cat([scales, data], dim=-1).view(h, nb, bs, d + FP8_ROW_EXTRA).view(torch.float8_e4m3fn)
