"""Paged attention in Triton: the flat batch (prompt chunks and decodes together) in one
kernel, a split-K kernel for decode steps over long contexts, and RoPE fused with the K/V
cache write.

The cache layout is the CPU backend's (backends/base.py): per layer K and V of
[kv_heads, num_blocks, block_size, head_dim], head-major, so a block of one KV head is
block_size x head_dim contiguous values (one coalesced read), and slot s of the flat
slot mapping is block s // block_size, row s % block_size.

`varlen_attention`: one program per (tile of query tokens of one request, KV head). The
tile's rows are its tokens times the query heads of that KV head (GQA: the KV head's
blocks are read once for all of them), padded to a power of two of at least 16 for
tl.dot. It walks the request's block table up to the last key any of its rows sees, with
an online softmax; each query at position p (the chunk's tokens are the last q_len of
the request's seq_len) sees keys 0..p, so prefix hits (keys computed by another
request) and chunked prefill need nothing special. A sliding-window layer (`window` > 0)
sees keys p - window + 1..p: the walk starts at the tile's first row's window. Scores and the softmax are float32;
the products run in the cache's dtype with float32 sums, as flash attention does.

`decode_attention`: a decode-only step (one query a request) over contexts long enough
that one program per (request, KV head) would leave most of the GPU idle: the keys are cut
into `splits` ranges, each program computes its range's partial softmax (maximum, sum,
weighted values), and a second kernel merges the ranges exactly.

Every kernel runs under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1), which is
how the suite proves them against the torch reference without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sluice.backends.cuda.fp8 import e4m3_round
from sluice.backends.cuda.gemv import ieee_products
from sluice.backends.cuda.ops import rows_per_program


# Values a RoPE program holds at once (rows of (token, head) times half a head).
ROPE_TILE = 2048


def _pow2(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


@dataclass
class _CacheArgs:
    """What a kernel is given for a layer's K and V caches: the values' tensors, the
    scales' (FP8: the same bytes as float32; else the values again, unread), the strides
    in elements, and where a block's values start."""
    k: torch.Tensor
    v: torch.Tensor
    ks: torch.Tensor
    vs: torch.Tensor
    stride_kh: int
    stride_kb: int
    stride_ks: int
    fp8: bool
    data0: int


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int) -> _CacheArgs:
    if k_cache.dtype != torch.float8_e4m3fn:
        return _CacheArgs(k_cache, v_cache, k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                          False, 0)
    # The FP8 layout (backends/kv_fp8.py): per block, block_size float32 scales, then the rows.
    bs = k_cache.shape[2]
    return _CacheArgs(k_cache, v_cache, k_cache.view(torch.float32), v_cache.view(torch.float32), k_cache.stride(0),
                      k_cache.stride(1), head_dim, True, bs * 4)


@triton.jit
def _attend(q, K, V, KS, VS, base, row, d, j_ok, kv_ok, visible, scale, m_i, l_i, acc, stride_ks,
            IEEE: tl.constexpr, FP8: tl.constexpr, DATA0: tl.constexpr):
    """One tile of keys into a running online softmax: the scores of q against the keys of
    rows `row` of the blocks at `base` (those `visible`), then (max, sum, weighted values)
    rescaled and extended. FP8: the values start DATA0 bytes into each block, and each
    key's scores and each value's weight are scaled by its token's scale (KS, VS: the
    same caches as float32, a block's first block_size words)."""
    at = base[:, None] + DATA0 + row[:, None] * stride_ks + d[None, :]
    k = tl.load(K + at, mask=kv_ok, other=0.0)
    if FP8:
        k = k.to(q.dtype)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if FP8:
        s = s * tl.load(KS + base // 4 + row, mask=j_ok, other=0.0)[None, :]
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row none of whose keys is visible yet keeps m = -inf: no exp(-inf - -inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(V + at, mask=kv_ok, other=0.0)
    if FP8:
        v = v.to(q.dtype)
        p = p * tl.load(VS + base // 4 + row, mask=j_ok, other=0.0)[None, :]
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def _varlen_kernel(Q, K, V, KS, VS, Out, block_tables, seq_lens, query_start, tile_req, tile_q0, scale, window,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kb, stride_ks, stride_bt,
                   G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                   ROWS: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                   FP8: tl.constexpr, DATA0: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tile_req + tile)
    q0 = tl.load(tile_q0 + tile)
    q_start = tl.load(query_start + req)
    q_len = tl.load(query_start + req + 1) - q_start
    seq_len = tl.load(seq_lens + req)
    ctx = seq_len - q_len
    r = tl.arange(0, ROWS)
    tok = q0 + r // G
    head = kvh * G + r % G
    row_ok = (r < BLOCK_Q * G) & (tok < q_len)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    pos = ctx + tok
    # The last key any row of this tile sees (exclusive), and the first (its first row's window).
    last = tl.minimum(ctx + q0 + BLOCK_Q, seq_len)
    first = tl.where(window > 0, tl.maximum(ctx + q0 - window + 1, 0), 0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(first, last, BLOCK_N):
        j = start + n
        j_ok = j < last
        blk = tl.load(block_tables + req * stride_bt + j // BLOCK_SIZE, mask=j_ok, other=0)
        base = kvh * stride_kh + blk.to(tl.int64) * stride_kb
        kv_ok = j_ok[:, None] & d_ok[None, :]
        visible = (j[None, :] <= pos[:, None]) & j_ok[None, :]
        visible = visible & ((window == 0) | (j[None, :] > pos[:, None] - window))
        m_i, l_i, acc = _attend(q, K, V, KS, VS, base, j % BLOCK_SIZE, d, j_ok, kv_ok, visible, scale, m_i, l_i, acc,
                                stride_ks, IEEE, FP8, DATA0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def varlen_tiles(query_start: list[int], block_q: int, requests=None) -> tuple[list[int], list[int]]:
    """The (request, first query) of each tile of `block_q` query tokens of `requests`
    (default all), request by request (host lists, built with the step's other metadata)."""
    reqs, q0s = [], []
    for i in range(len(query_start) - 1) if requests is None else requests:
        for q0 in range(0, query_start[i + 1] - query_start[i], block_q):
            reqs.append(i)
            q0s.append(q0)
    return reqs, q0s


def block_q_for(group: int, max_q: int) -> int:
    """Query tokens per tile: enough rows (tokens x the KV head's query heads) to fill a
    16-row tl.dot and at most 64 rows, never more tokens than the longest chunk needs."""
    rows = min(64, max(16, group * max_q))
    return max(1, min(_pow2(max_q), rows // group if group <= rows else 1))


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, query_start: torch.Tensor, tile_req: torch.Tensor,
                     tile_q0: torch.Tensor, block_q: int, scale: float, out: torch.Tensor | None = None,
                     window: int = 0, key_tile: int = 16) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D]; the caches [Hkv, blocks, block_size, D]; the tiles from
    varlen_tiles(query_start, block_q). Rows past query_start[-1] (a padded batch) are
    left as `out` holds them (zeros when it is made here). window > 0: each query sees its
    last `window` keys only (itself included). key_tile: keys a program scores per loop
    step, at least a block."""
    t, hq, d = q.shape
    hkv, _, bs, _ = k_cache.shape
    group = hq // hkv
    out = torch.zeros_like(q) if out is None else out
    if tile_req.numel() == 0:
        return out
    rows = _pow2(block_q * group, 16)
    grid = (tile_req.numel(), hkv)
    c = _cache_args(k_cache, v_cache, d)
    _varlen_kernel[grid](q, c.k, c.v, c.ks, c.vs, out, block_tables, seq_lens, query_start, tile_req, tile_q0, scale,
                         window, q.stride(0), q.stride(1), out.stride(0), out.stride(1), c.stride_kh, c.stride_kb,
                         c.stride_ks, block_tables.stride(0),
                         G=group, HEAD_DIM=d, D_PAD=_pow2(d, 16), BLOCK_Q=block_q, ROWS=rows, BLOCK_SIZE=bs,
                         BLOCK_N=max(key_tile, bs), IEEE=ieee_products(q.dtype), FP8=c.fp8, DATA0=c.data0)
    return out


@triton.jit
def _decode_split_kernel(Q, K, V, KS, VS, Mid, Lse, block_tables, seq_lens, scale, split_len, window,
                         stride_qt, stride_qh, stride_kh, stride_kb, stride_ks, stride_bt,
                         stride_mt, stride_mh, stride_ms, stride_lt, stride_lh,
                         G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, ROWS: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
                         FP8: tl.constexpr, DATA0: tl.constexpr):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + req)
    lo = split * split_len
    hi = tl.minimum(lo + split_len, seq_len)
    lo = tl.where(window > 0, tl.maximum(lo, seq_len - window), lo)  # a sliding window's keys only
    r = tl.arange(0, ROWS)
    head = kvh * G + r
    row_ok = r < G
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(Q + req * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None] & d_ok[None, :],
                other=0.0)
    m_i = tl.full([ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        j = start + n
        j_ok = j < hi
        blk = tl.load(block_tables + req * stride_bt + j // BLOCK_SIZE, mask=j_ok, other=0)
        base = kvh * stride_kh + blk.to(tl.int64) * stride_kb
        kv_ok = j_ok[:, None] & d_ok[None, :]
        m_i, l_i, acc = _attend(q, K, V, KS, VS, base, j % BLOCK_SIZE, d, j_ok, kv_ok, j_ok[None, :], scale, m_i, l_i,
                                acc, stride_ks, IEEE, FP8, DATA0)
    # The split's normalised values and its log-sum-exp (-inf for an empty split).
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(Mid + req * stride_mt + head[:, None] * stride_mh + split * stride_ms + d[None, :], out,
             mask=row_ok[:, None] & d_ok[None, :])
    tl.store(Lse + req * stride_lt + head * stride_lh + split, lse, mask=row_ok)


@triton.jit
def _decode_merge_kernel(Mid, Lse, Out, stride_mt, stride_mh, stride_ms, stride_lt, stride_lh, stride_ot, stride_oh,
                         SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    req = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_ok = s < SPLITS
    d_ok = d < HEAD_DIM
    lse = tl.load(Lse + req * stride_lt + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    # A request with no keys at all (a padding row of a captured batch) gets zeros, not NaN.
    w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - tl.where(top == float("-inf"), 0.0, top)))
    w = w / tl.maximum(tl.sum(w, 0), 1e-30)
    mid = tl.load(Mid + req * stride_mt + h * stride_mh + s[:, None] * stride_ms + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(mid * w[:, None], 0)
    tl.store(Out + req * stride_ot + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_ok)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, splits: int, split_len: int, scale: float,
                     out: torch.Tensor | None = None, window: int = 0, key_tile: int = 16) -> torch.Tensor:
    """One query token a request (q [B, Hq, D], row i is request i), its keys cut into
    `splits` ranges of `split_len` tokens (splits * split_len >= the longest seq_len; a
    range past a request's length is empty and weighs nothing in the merge). key_tile as
    in varlen_attention."""
    b, hq, d = q.shape
    hkv, _, bs, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    mid = torch.empty((b, hq, splits, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq, splits), dtype=torch.float32, device=q.device)
    c = _cache_args(k_cache, v_cache, d)
    _decode_split_kernel[(b, hkv, splits)](
        q, c.k, c.v, c.ks, c.vs, mid, lse, block_tables, seq_lens, scale, split_len, window,
        q.stride(0), q.stride(1), c.stride_kh, c.stride_kb, c.stride_ks, block_tables.stride(0),
        mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0), lse.stride(1),
        G=group, HEAD_DIM=d, D_PAD=_pow2(d, 16), ROWS=_pow2(group, 16), BLOCK_SIZE=bs, BLOCK_N=max(key_tile, bs),
        IEEE=ieee_products(q.dtype), FP8=c.fp8, DATA0=c.data0)
    _decode_merge_kernel[(b, hq)](mid, lse, out, mid.stride(0), mid.stride(1), mid.stride(2), lse.stride(0),
                                  lse.stride(1), out.stride(0), out.stride(1), SPLITS=splits, S_PAD=_pow2(splits),
                                  HEAD_DIM=d, D_PAD=_pow2(d))
    return out


@triton.jit
def _rope_write_kernel(QKV, Cos, Sin, Qout, K, V, KS, VS, slots, n_tok, stride_t, stride_ct, stride_qt, stride_qh,
                       stride_kh, stride_kb, stride_ks,
                       HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                       H_PAD: tl.constexpr, TOKENS: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    """TOKENS tokens a program, a row per (token, head): RoPE (rotate-half) on the query and
    key heads, q to Qout, k and v into the cache at the token's slot. Products in float32,
    one rounding each, as torch's x * cos + rotate_half(x) * sin (in the model's dtype)
    would not promise: the reference comparison is to rounding. FP8: k (rounded to the
    model's dtype first, as the torch path holds it) and v quantized per head with their
    scales (kv_fp8.py)."""
    r = tl.arange(0, TOKENS * H_PAD)
    t = tl.program_id(0) * TOKENS + r // H_PAD
    h = r % H_PAD
    t_ok = (t < n_tok)[:, None]
    i = tl.arange(0, HALF)
    cs = Cos + t[:, None] * stride_ct + i[None, :]
    sn = Sin + t[:, None] * stride_ct + i[None, :]
    cos1 = tl.load(cs, mask=t_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cs + HALF, mask=t_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sn, mask=t_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sn + HALF, mask=t_ok, other=0.0).to(tl.float32)
    base = QKV + t[:, None] * stride_t
    qm = (h < HQ)[:, None] & t_ok
    x1 = tl.load(base + h[:, None] * HEAD_DIM + i[None, :], mask=qm, other=0.0).to(tl.float32)
    x2 = tl.load(base + h[:, None] * HEAD_DIM + HALF + i[None, :], mask=qm, other=0.0).to(tl.float32)
    qo = Qout + t[:, None] * stride_qt + h[:, None] * stride_qh
    tl.store(qo + i[None, :], (x1 * cos1 - x2 * sin1).to(Qout.dtype.element_ty), mask=qm)
    tl.store(qo + HALF + i[None, :], (x2 * cos2 + x1 * sin2).to(Qout.dtype.element_ty), mask=qm)
    slot = tl.load(slots + t, mask=t < n_tok, other=0).to(tl.int64)[:, None]
    kvm = (h < HKV)[:, None] & t_ok
    kb = base + HQ * HEAD_DIM + h[:, None] * HEAD_DIM
    k1 = tl.load(kb + i[None, :], mask=kvm, other=0.0).to(tl.float32)
    k2 = tl.load(kb + HALF + i[None, :], mask=kvm, other=0.0).to(tl.float32)
    r1 = k1 * cos1 - k2 * sin1
    r2 = k2 * cos2 + k1 * sin2
    vb = base + (HQ + HKV) * HEAD_DIM + h[:, None] * HEAD_DIM
    v1 = tl.load(vb + i[None, :], mask=kvm, other=0.0)
    v2 = tl.load(vb + HALF + i[None, :], mask=kvm, other=0.0)
    if FP8:
        blk = h[:, None] * stride_kh + (slot // BLOCK_SIZE) * stride_kb
        row = slot % BLOCK_SIZE
        dst = blk + BLOCK_SIZE * 4 + row * HEAD_DIM
        r1 = r1.to(QKV.dtype.element_ty).to(tl.float32)
        r2 = r2.to(QKV.dtype.element_ty).to(tl.float32)
        _write_fp8_row(K, KS, blk // 4 + row, dst, i, r1, r2, kvm, HALF)
        _write_fp8_row(V, VS, blk // 4 + row, dst, i, v1.to(tl.float32), v2.to(tl.float32), kvm, HALF)
    else:
        dst = h[:, None] * stride_kh + (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
        tl.store(K + dst + i[None, :], r1.to(K.dtype.element_ty), mask=kvm)
        tl.store(K + dst + HALF + i[None, :], r2.to(K.dtype.element_ty), mask=kvm)
        tl.store(V + dst + i[None, :], v1, mask=kvm)
        tl.store(V + dst + HALF + i[None, :], v2, mask=kvm)


@triton.jit
def _write_fp8_row(C, CS, scale_at, dst, i, x1, x2, ok, HALF: tl.constexpr):
    """One token's values of each head (two halves [H, HALF], float32) into an FP8 cache:
    scale = max|x| / 448 per head, values e4m3(x * 448 / max|x|) (kv_fp8.py)."""
    top = tl.maximum(tl.maximum(tl.max(tl.abs(x1), 1), tl.max(tl.abs(x2), 1)), 1e-12)
    inv = (448.0 / top)[:, None]
    y1 = e4m3_round(tl.minimum(tl.maximum(x1 * inv, -448.0), 448.0))
    y2 = e4m3_round(tl.minimum(tl.maximum(x2 * inv, -448.0), 448.0))
    tl.store(C + dst + i[None, :], y1.to(C.dtype.element_ty), mask=ok)
    tl.store(C + dst + HALF + i[None, :], y2.to(C.dtype.element_ty), mask=ok)
    tl.store(CS + scale_at, (top / 448.0)[:, None], mask=ok)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> q [T, Hq, D] after RoPE; K (after RoPE) and V written
    into the caches at the slots. cos, sin: [T, D] (or [T, 1, D])."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    cos2, sin2 = cos.reshape(t, head_dim), sin.reshape(t, head_dim)
    qkv = qkv.contiguous()
    c = _cache_args(k_cache, v_cache, head_dim)
    h_pad = _pow2(max(num_heads, num_kv_heads))
    # Tokens a program: a tile of up to ROPE_TILE values (one token of a 32-head model of
    # head_dim 128; 64 of a small test model's), as the norms in ops.py take rows.
    tokens = rows_per_program(t, h_pad * (head_dim // 2), ROPE_TILE)
    _rope_write_kernel[(triton.cdiv(t, tokens),)](
        qkv, cos2, sin2, q, c.k, c.v, c.ks, c.vs, slot_mapping, t, qkv.stride(0), cos2.stride(0), q.stride(0),
        q.stride(1), c.stride_kh, c.stride_kb, c.stride_ks, HQ=num_heads, HKV=num_kv_heads, HEAD_DIM=head_dim,
        HALF=head_dim // 2, H_PAD=h_pad, TOKENS=tokens, BLOCK_SIZE=k_cache.shape[2], FP8=c.fp8)
    return q
