"""The CUDA backend's Triton kernels against a plain torch reference, on small shapes:
chunked prefill, decodes, mixed batches, GQA, block boundaries, prefix hits, long contexts
through split-K, RoPE with the cache write, the norms and SwiGLU. Without a GPU they run
under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, which tests/conftest.py
sets before Triton is imported), so CI proves every kernel; on a GPU the same tests run
the compiled kernels."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from sluice.backends.cuda import attention as ta  # noqa: E402
from sluice.backends.cuda import ops as tops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def ref_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, scale, window=0):
    """Each request's keys gathered through its block table, each query at position p
    attending to keys 0..p (p - window + 1..p with a window), in float64."""
    hkv, _, bs, d = k_cache.shape
    g = q.shape[1] // hkv
    out = torch.zeros_like(q, dtype=torch.float64)
    for i in range(len(seq_lens)):
        lo, hi = int(query_start[i]), int(query_start[i + 1])
        n, ql = int(seq_lens[i]), hi - lo
        blocks = block_tables[i, :(n + bs - 1) // bs].long()
        k = k_cache[:, blocks].reshape(hkv, -1, d)[:, :n].double().repeat_interleave(g, 0)   # [Hq, n, D]
        v = v_cache[:, blocks].reshape(hkv, -1, d)[:, :n].double().repeat_interleave(g, 0)
        qq = q[lo:hi].double().transpose(0, 1)                                             # [Hq, ql, D]
        s = qq @ k.transpose(1, 2) * scale
        pos = torch.arange(n - ql, n)[:, None]
        s = s.masked_fill(torch.arange(n)[None, :] > pos, float("-inf"))
        if window:
            s = s.masked_fill(torch.arange(n)[None, :] <= pos - window, float("-inf"))
        out[lo:hi] = (torch.softmax(s, -1) @ v).transpose(0, 1)
    return out


def make_batch(rng: random.Random, chunks: list[tuple[int, int]], hq: int, hkv: int, d: int, bs: int,
               dtype=torch.float32):
    """chunks: (tokens already cached, query tokens) per request. Blocks are handed out in
    a shuffled order (a real pool's table is never contiguous)."""
    need = sum((c + q + bs - 1) // bs for c, q in chunks)
    order = list(range(1, need + 1))
    rng.shuffle(order)
    nb = need + 2
    k_cache = torch.randn(hkv, nb, bs, d, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(hkv, nb, bs, d, dtype=dtype, device=DEVICE)
    tables, seq_lens, qs = [], [], [0]
    for c, ql in chunks:
        n = c + ql
        k = (n + bs - 1) // bs
        tables.append([order.pop() for _ in range(k)])
        seq_lens.append(n)
        qs.append(qs[-1] + ql)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)
    q = torch.randn(qs[-1], hq, d, dtype=dtype, device=DEVICE)
    return (q, k_cache, v_cache, bt, torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
            torch.tensor(qs, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("hq, hkv, d, bs, chunks", [
    (4, 4, 16, 16, [(0, 5)]),                                # one prompt, MHA
    (6, 2, 32, 16, [(0, 37), (10, 1), (0, 1), (31, 17)]),    # GQA: prompts, decodes, a chunk after a prefix
    (9, 3, 64, 16, [(15, 1), (16, 1), (17, 1), (47, 3)]),    # SmolLM2's heads; block boundaries; drafts
    (8, 2, 16, 8, [(0, 64), (100, 20)]),                     # several blocks per key tile; long chunk
    (2, 1, 16, 32, [(5, 40)]),                               # a block bigger than the key tile
])
def test_varlen_attention_matches_the_reference(hq, hkv, d, bs, chunks):
    rng = random.Random(hq * 100 + d)
    q, kc, vc, bt, sl, qs = make_batch(rng, chunks, hq, hkv, d, bs)
    scale = d ** -0.5
    want = ref_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qs.cpu(), scale)
    max_q = max(q for _, q in chunks)
    block_q = ta.block_q_for(hq // hkv, max_q)
    reqs, q0s = ta.varlen_tiles(qs.tolist(), block_q)
    got = ta.varlen_attention(q, kc, vc, bt, sl, qs, torch.tensor(reqs, dtype=torch.int32, device=DEVICE),
                              torch.tensor(q0s, dtype=torch.int32, device=DEVICE), block_q, scale)
    assert (got.double().cpu() - want).abs().max() < 1e-4


def test_varlen_attention_in_bfloat16_is_close():
    rng = random.Random(3)
    q, kc, vc, bt, sl, qs = make_batch(rng, [(0, 20), (30, 1), (7, 9)], 4, 2, 32, 16, dtype=torch.bfloat16)
    want = ref_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qs.cpu(), 32 ** -0.5)
    reqs, q0s = ta.varlen_tiles(qs.tolist(), 8)
    got = ta.varlen_attention(q, kc, vc, bt, sl, qs, torch.tensor(reqs, dtype=torch.int32, device=DEVICE),
                              torch.tensor(q0s, dtype=torch.int32, device=DEVICE), 8, 32 ** -0.5)
    assert (got.double().cpu() - want).abs().max() < 3e-2


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_k_decode_matches_the_reference(splits):
    rng = random.Random(splits)
    chunks = [(200, 1), (5, 1), (129, 1), (64, 1)]
    q, kc, vc, bt, sl, qs = make_batch(rng, chunks, 8, 2, 32, 16)
    want = ref_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qs.cpu(), 32 ** -0.5)
    longest = max(c + 1 for c, _ in chunks)
    split_len = -(-longest // splits)
    got = ta.decode_attention(q, kc, vc, bt, sl, splits, split_len, 32 ** -0.5)
    assert (got.double().cpu() - want).abs().max() < 1e-4


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_in_both_kernels(window):
    """A sliding-window layer (Gemma 3, Mistral): the flat kernel's prompt chunks and decodes
    and the split-K decode each see only the last `window` keys of a query."""
    rng = random.Random(window)
    chunks = [(0, 37), (10, 1), (31, 17), (100, 1), (3, 2)]
    q, kc, vc, bt, sl, qs = make_batch(rng, chunks, 6, 2, 32, 16)
    want = ref_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qs.cpu(), 32 ** -0.5, window)
    block_q = ta.block_q_for(3, 37)
    reqs, q0s = ta.varlen_tiles(qs.tolist(), block_q)
    got = ta.varlen_attention(q, kc, vc, bt, sl, qs, torch.tensor(reqs, dtype=torch.int32, device=DEVICE),
                              torch.tensor(q0s, dtype=torch.int32, device=DEVICE), block_q, 32 ** -0.5, window=window)
    assert (got.double().cpu() - want).abs().max() < 1e-4
    decodes = [(200, 1), (5, 1), (129, 1)]
    q, kc, vc, bt, sl, qs = make_batch(rng, decodes, 8, 2, 32, 16)
    want = ref_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qs.cpu(), 32 ** -0.5, window)
    got = ta.decode_attention(q, kc, vc, bt, sl, 4, 51, 32 ** -0.5, window=window)
    assert (got.double().cpu() - want).abs().max() < 1e-4


@pytest.mark.parametrize("tile", [None, 256])
def test_rope_write_kv_matches_the_torch_ops(tile, monkeypatch):
    """All 7 tokens in one program (the tile's default), and two tokens a program with the
    last one's second row past the end (tile 256 over 8 padded heads of 16 values)."""
    from sluice.backends.torch_ref import TORCH_OPS
    if tile:
        monkeypatch.setattr(ta, "ROPE_TILE", tile)
    torch.manual_seed(0)
    t, hq, hkv, d, bs = 7, 6, 2, 32, 16
    qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEVICE)
    pos = torch.tensor([0, 1, 2, 40, 41, 17, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, -1)
    cos, sin = emb.cos()[:, None, :].to(DEVICE), emb.sin()[:, None, :].to(DEVICE)
    slots = torch.tensor([3, 4, 5, 40, 41, 17, 60], device=DEVICE)
    caches = [(torch.zeros(hkv, 5, bs, d, device=DEVICE), torch.zeros(hkv, 5, bs, d, device=DEVICE)) for _ in range(2)]
    want_q = TORCH_OPS.rope_write_kv(qkv, cos, sin, caches[0], slots, hq, hkv, d)
    got_q = ta.rope_write_kv(qkv, cos, sin, caches[1][0], caches[1][1], slots, hq, hkv, d)
    assert (got_q - want_q).abs().max() < 1e-5
    assert (caches[1][0] - caches[0][0]).abs().max() < 1e-5
    assert torch.equal(caches[1][1], caches[0][1])


@pytest.mark.parametrize("tile", [None, 256])
def test_norms_and_swiglu_match_the_torch_ops(tile, monkeypatch):
    """All 5 rows in one program (the tile's default), and two rows a program with the last
    one's second row past the end (tile 256 over rows padded to 128)."""
    from sluice.backends.torch_ref import TORCH_OPS
    if tile:
        monkeypatch.setattr(tops, "TILE_ELEMENTS", tile)
    torch.manual_seed(1)
    x, res = torch.randn(5, 96, device=DEVICE), torch.randn(5, 96, device=DEVICE)
    w = torch.randn(96, device=DEVICE)
    assert (tops.rms_norm(x, w, 1e-5) - TORCH_OPS.rms_norm(x, w, 1e-5)).abs().max() < 1e-5
    got, got_sum = tops.add_rms_norm(x, res, w, 1e-5)
    want, want_sum = TORCH_OPS.add_rms_norm(x, res, w, 1e-5)
    assert (got - want).abs().max() < 1e-5 and torch.equal(got_sum, want_sum)
    gu = torch.randn(5, 2 * 80, device=DEVICE)
    assert (tops.silu_and_mul(gu) - TORCH_OPS.silu_and_mul(gu)).abs().max() < 1e-5
