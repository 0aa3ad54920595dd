"""Paged attention: one C++ kernel call per step where our kernels run, torch ops elsewhere.

Cache layout per layer: [kv_heads, num_blocks, block_size, head_dim], head-major, so that
gathering a request's blocks yields [kv_heads, tokens, head_dim] with no further copy.
New K/V are written through `slot_mapping` (block_id * block_size + offset); past K/V
are read only through block tables. With our bf16 C++ kernels (worker/kernels) every token
of a step, prompt chunk or decode, goes through one paged_attention_varlen call that walks
the block tables in place, one per-token routine, so the same routine serves deterministic
mode, where it makes a token's output independent of its batch. Otherwise (float32, no
AVX-512, GPU) decode tokens go through the C++ decode kernel where it is built, else two
batched matmuls over their gathered blocks, and each prefill chunk runs one
scaled_dot_product_attention call with a causal mask offset by the tokens it already has
in the cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int        # rows [token_start, token_end) of the flat batch
    token_end: int
    start_pos: int          # tokens of this request already in the cache
    seq_len: int            # context length after this step
    block_ids: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [q, seq_len] bool, None when plain causal from 0


@dataclass
class AttentionMetadata:
    """Flat-batch attention record, built by the runner and passed explicitly."""
    slot_mapping: torch.Tensor          # [T] cache slot of each new token
    query_start_loc: torch.Tensor       # [B+1] offsets of each request in the flat batch
    seq_lens: torch.Tensor              # [B] context length of each request after this step
    block_tables: torch.Tensor          # [B, max_blocks], padded with 0
    # Decodes (one query token each), batched.
    decode_token_idx: torch.Tensor | None   # [Bd] rows of the flat batch
    decode_block_tables: torch.Tensor | None  # [Bd, blocks]
    decode_mask: torch.Tensor | None        # [1, Bd, 1, blocks * block_size] bool, True = attend
    decode_seq_lens: torch.Tensor | None    # [Bd]
    prefills: list[PrefillChunk]
    # The compiled CPU decode kernel (worker/kernels), or None for the torch path.
    decode_kernel: object | None = None
    # Deterministic mode: the kernels whose paged_attention_varlen computes every token,
    # prefill or decode, through one per-token routine (batch-invariant).
    batch_invariant_kernels: object | None = None


# An int8 KV cache (kv_cache_dtype="int8") is uint8 [Hkv, num_blocks, block_size, D + 4]:
# the bytes of each block (one kv head) are block_size float32 scales, one per token, then
# block_size x D int8 values (x ~ scale * value). V's values are stored row by row; K's
# as value + 128, grouped [block_size / 16][D / 4][16 tokens][4 dims], the order the
# kernel's int8 dot products read them in (worker/kernels/simd.h).
INT8_ROW_EXTRA = 4


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., D] -> (int8 [..., D], float32 scales [...]), one symmetric scale per row:
    value = round(x * 127 / absmax) (half to even), scale = absmax / 127. The same bits as
    the kernels' cache write (simd.h, quantize_row_i8)."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    # 127 / amax as one division (a Python number divided by a tensor is torch's
    # reciprocal times the number: another rounding, off by one in a few values).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return torch.round(xf * inv).to(torch.int8), (amax / 127.0).squeeze(-1)


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


def _int8_write(cache: torch.Tensor, x: torch.Tensor, slot_mapping: torch.Tensor, is_k: bool) -> None:
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


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k_cache: [Hkv, num_blocks, block_size, D] (D + 4 bytes for int8); k: [T, Hkv, D]."""
    if k_cache.dtype == torch.uint8:
        _int8_write(k_cache, k, slot_mapping, is_k=True)
        _int8_write(v_cache, v, slot_mapping, is_k=False)
        return
    h, _, _, d = k_cache.shape
    k_cache.view(h, -1, d).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(h, -1, d).index_copy_(1, slot_mapping, v.transpose(0, 1))


def flat_attention_kernel(meta: AttentionMetadata):
    """The kernel module that computes the whole flat batch in one call, or None: always in
    deterministic mode (every token through one per-token routine), and otherwise for steps
    with no SDPA prompt chunk: decode-only steps, and every step where the runner sends
    prompt chunks to the kernel too (bf16 with our kernels). Padding rows come out as zeros."""
    if meta.batch_invariant_kernels is not None:
        return meta.batch_invariant_kernels
    return meta.decode_kernel if not meta.prefills else None


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D], attending over each request's cached K/V."""
    flat = flat_attention_kernel(meta)
    if flat is not None:
        return flat.paged_attention_varlen(q.contiguous(), k_cache, v_cache, meta.block_tables,
                                           meta.query_start_loc, meta.seq_lens, scale)
    # Zeros, not empty: rows that pad a bucketed batch are attended by nobody and must stay finite.
    out = torch.zeros_like(q)
    num_kv_heads, head_dim = k_cache.shape[0], k_cache.shape[3]
    if meta.decode_token_idx is not None and meta.decode_kernel is not None:
        qd = q.index_select(0, meta.decode_token_idx)
        od = meta.decode_kernel.paged_decode_attention(qd, k_cache, v_cache, meta.decode_block_tables,
                                                       meta.decode_seq_lens, scale)
        out.index_copy_(0, meta.decode_token_idx, od)
    elif meta.decode_token_idx is not None:
        # Two batched matmuls rather than SDPA: with one query per sequence, the CPU flash
        # kernel is ~10x slower than this (measured: 0.8 ms vs 10 ms for 32 x 560 tokens).
        bt = meta.decode_block_tables
        bd = bt.shape[0]
        group = q.shape[1] // num_kv_heads
        qd = q.index_select(0, meta.decode_token_idx).view(bd, num_kv_heads, group, head_dim).transpose(0, 1)
        kd = k_cache[:, bt].view(num_kv_heads, bd, -1, head_dim)          # [Hkv, Bd, L, D]
        vd = v_cache[:, bt].view(num_kv_heads, bd, -1, head_dim)
        scores = torch.matmul(qd, kd.transpose(-1, -2)).float() * scale  # [Hkv, Bd, G, L]
        scores = scores.masked_fill_(~meta.decode_mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        od = torch.matmul(probs, vd)                                      # [Hkv, Bd, G, D]
        out.index_copy_(0, meta.decode_token_idx, od.transpose(0, 1).reshape(bd, -1, head_dim))
    for p in meta.prefills:
        qp = q[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)       # [1, Hq, q, D]
        # Repeating K/V per query head beats SDPA's enable_gqa on CPU (measured: 12 ms vs
        # 20.6 ms at 1,024 tokens, equal at 210).
        group = q.shape[1] // num_kv_heads
        kp = k_cache[:, p.block_ids].view(1, num_kv_heads, -1, head_dim)[:, :, :p.seq_len]
        vp = v_cache[:, p.block_ids].view(1, num_kv_heads, -1, head_dim)[:, :, :p.seq_len]
        if group > 1:
            kp, vp = kp.repeat_interleave(group, dim=1), vp.repeat_interleave(group, dim=1)
        if p.mask is None:
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale)
        else:
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale)
        out[p.token_start:p.token_end] = op.squeeze(0).transpose(0, 1)
    return out
