"""The int8 KV cache's format (kv_cache_dtype="int8"): how values are quantized and where
their bytes go. The CPU kernels read and write it (backends/cpu/x86/simd.h) and these
torch functions write the same bytes (the torch path of models whose per-head norms keep
RoPE in Python, and the tests and benchmarks that build caches)."""
from __future__ import annotations

import torch

# An int8 KV cache (kv_cache_dtype="int8") is uint8 [Hkv, num_blocks, block_size, D + 4]:
# the bytes of each block (one kv head) are block_size float32 scales, one per token, then
# block_size x D int8 values (x ~ scale * value). V's values are stored row by row; K's
# as value + 128, grouped [block_size / 16][D / 4][16 tokens][4 dims], the order the
# kernel's int8 dot products read them in (backends/cpu/x86/simd.h).
INT8_ROW_EXTRA = 4


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scales [...]), one symmetric scale per row:
    value = round(x * 127 / absmax) (half to even), scale = absmax / 127. The same bits as
    the kernels' cache write (simd.h, quantize_row_i8)."""
    # The row's absolute maximum in x's own dtype (a max is exact in any dtype), then the
    # float32 work in place: 4x faster on bf16 blocks than the same steps on a float copy.
    amax = x.abs().amax(-1, keepdim=True).float()
    # 127 / amax as one division (a Python number divided by a tensor is torch's
    # reciprocal times the number: another rounding, off by one in a few values).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return x.to(torch.float32, copy=True).mul_(inv).round_().to(torch.int8), (amax / 127.0).squeeze(-1)


def _int8_data(q: torch.Tensor, is_k: bool) -> torch.Tensor:
    """int8 [..., n, D] (n tokens, a multiple of 16 for K) -> the block's data bytes [..., n * D]."""
    *lead, n, d = q.shape
    if not is_k:
        return q.view(torch.uint8).reshape(*lead, n * d)
    u = (q.to(torch.int16) + 128).to(torch.uint8).reshape(*lead, n // 16, 16, d // 4, 4)
    return u.transpose(-3, -2).reshape(*lead, n * d)


def int8_cache_from_dense(dense: torch.Tensor, is_k: bool) -> torch.Tensor:
    """[Hkv, blocks, bs, D] values -> the int8 cache holding them (for tests and benchmarks)."""
    h, nb, bs, d = dense.shape
    q, scale = quantize_rows_int8(dense)
    scales = scale.contiguous().view(torch.uint8).reshape(h, nb, bs * 4)
    return torch.cat([scales, _int8_data(q, is_k)], dim=-1).view(h, nb, bs, d + INT8_ROW_EXTRA)


def dense_from_int8_cache(cache: torch.Tensor, is_k: bool) -> torch.Tensor:
    """The inverse of int8_cache_from_dense, in float32."""
    h, nb, bs, d4 = cache.shape
    d = d4 - INT8_ROW_EXTRA
    flat = cache.reshape(h, nb, bs * d4)
    scale = flat[..., :bs * 4].contiguous().view(torch.float32)          # [h, nb, bs]
    data = flat[..., bs * 4:]
    if is_k:
        values = data.reshape(h, nb, bs // 16, d // 4, 16, 4).transpose(-3, -2).reshape(h, nb, bs, d)
        values = values.to(torch.int16) - 128
    else:
        values = data.reshape(h, nb, bs, d).view(torch.int8)
    return values.float() * scale[..., None]


def write_int8(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, is_k: bool) -> None:
    """Quantize x [T, Hkv, D] into the int8 cache at the slots' places."""
    h, _, bs, d4 = cache.shape
    d = d4 - INT8_ROW_EXTRA
    q, scale = quantize_rows_int8(x.transpose(0, 1))                     # [h, T, D], [h, T]
    slots = slot_mapping.to(torch.long)
    base = (slots // bs) * (bs * d4)
    off = slots % bs
    dims = torch.arange(d)
    if is_k:
        data_at = (bs * 4 + (off // 16)[:, None] * 16 * d + (dims // 4)[None, :] * 64
                   + (off % 16)[:, None] * 4 + (dims % 4)[None, :])
        data = (q.to(torch.int16) + 128).to(torch.uint8)
    else:
        data_at = bs * 4 + off[:, None] * d + dims[None, :]
        data = q.view(torch.uint8)
    scale_at = off[:, None] * 4 + torch.arange(4)[None, :]
    idx = torch.cat([base[:, None] + scale_at, base[:, None] + data_at], dim=1).reshape(-1)
    values = torch.cat([scale.contiguous().view(torch.uint8).reshape(h, -1, 4), data], dim=-1).reshape(h, -1)
    cache.view(h, -1)[:, idx] = values
