"""The int8 KV cache (kv_cache_dtype="int8"): its layout, the kernels' write and the torch
write agreeing byte for byte, attention over it against a float64 reference, and the
batch invariance every token's attention keeps."""
from __future__ import annotations

import pytest
import torch

from sluice.backends.kv_int8 import dense_from_int8_cache, int8_cache_from_dense, quantize_rows_int8
from sluice.backends.torch_ref import write_kv


@pytest.fixture
def k(isa_kernels):
    """Each build of the kernels this CPU runs (conftest.KERNEL_ISAS)."""
    return isa_kernels


def test_quantization_and_layout_round_trip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 32, 64, generator=g).bfloat16()
    x[0, 0, 0] = 0  # a zero row: scale 0, values 0
    q, scale = quantize_rows_int8(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale[0, 0, 0] == 0
    for is_k in (True, False):
        cache = int8_cache_from_dense(x, is_k)
        assert cache.dtype == torch.uint8 and cache.shape == (3, 5, 32, 68)
        back = dense_from_int8_cache(cache, is_k)
        err = (back - x.float()).abs().amax(-1)
        assert torch.all(err <= x.float().abs().amax(-1) / 254 * 1.0001)
    # K's block: the scales, then 4 dims of 16 tokens per 64 bytes.
    cache = int8_cache_from_dense(x, True).view(3, 5, -1)
    assert torch.equal(cache[1, 2, :4].view(torch.float32), scale[1, 2, :1])
    assert cache[1, 2, 32 * 4 + 1 * 4 + 2] == q[1, 2, 1, 2].item() + 128  # token 1, dim 2
    assert cache[1, 2, 32 * 4 + 64 + 3 * 4 + 1] == q[1, 2, 3, 5].item() + 128  # token 3, dim 5


def rope_inputs(T, hq, hkv, D, seed=1):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hkv) * D, generator=g).bfloat16()
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    f = torch.arange(T).float()[:, None] * inv[None]
    emb = torch.cat([f, f], -1)
    return qkv, emb.cos().bfloat16()[:, None], emb.sin().bfloat16()[:, None]


@pytest.mark.parametrize("D,bs", [(64, 16), (32, 32)])
def test_kernel_write_equals_torch_write(k, D, bs):
    """rope_write_kv into an int8 cache writes the bytes that write_kv (the path of models
    whose RoPE runs in Python) writes for the same rotated K and V rows."""
    hq, hkv, nb, T = 6, 2, 8, 37
    qkv, cos, sin = rope_inputs(T, hq, hkv, D)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(2))[:T]
    kb, vb = torch.zeros(hkv, nb, bs, D).bfloat16(), torch.zeros(hkv, nb, bs, D).bfloat16()
    q_bf16 = k.rope_write_kv(qkv, cos, sin, kb, vb, slots, hq, hkv)
    k8, v8 = torch.zeros(hkv, nb, bs, D + 4, dtype=torch.uint8), torch.zeros(hkv, nb, bs, D + 4, dtype=torch.uint8)
    assert torch.equal(k.rope_write_kv(qkv, cos, sin, k8, v8, slots, hq, hkv), q_bf16)
    kt, vt = torch.zeros_like(k8), torch.zeros_like(v8)
    rows = lambda c: c.view(hkv, -1, D)[:, slots].transpose(0, 1)  # noqa: E731
    write_kv(kt, vt, rows(kb), rows(vb), slots)
    assert torch.equal(kt, k8) and torch.equal(vt, v8)


def reference(q, kd, vd, tables, lens, scale):
    hkv, _, _, d = kd.shape
    out = []
    for i, n in enumerate(lens.tolist()):
        kk = kd[:, tables[i]].reshape(hkv, -1, d)[:, :n].double()
        vv = vd[:, tables[i]].reshape(hkv, -1, d)[:, :n].double()
        p = torch.softmax(q[i].double().view(hkv, -1, d) @ kk.transpose(-1, -2) * scale, -1)
        out.append((p @ vv).reshape(-1, d))
    return torch.stack(out)


@pytest.mark.parametrize("hkv,group,d,bs", [(3, 3, 64, 16), (2, 2, 128, 16), (1, 8, 64, 32), (2, 2, 32, 16)])
def test_attention_over_int8_cache_matches_float64(k, hkv, group, d, bs):
    """Decodes over an int8 cache against float64 attention over the same (dequantized)
    cache: within what quantizing q to int8 and the bf16 output allow. Head dims 64 and 128
    take the vectorised routine, 32 the plain one."""
    g = torch.Generator().manual_seed(hkv * d + bs)
    nb = 64
    kc, vc = torch.randn(hkv, nb, bs, d, generator=g), torch.randn(hkv, nb, bs, d, generator=g)
    k8, v8 = int8_cache_from_dense(kc, True), int8_cache_from_dense(vc, False)
    lens = torch.tensor([1, 5, 16, 17, 40, 63, 100, 301])
    nblk = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:nblk] for _ in lens])
    q = torch.randn(len(lens), hkv * group, d, generator=g).bfloat16()
    out = k.paged_attention_varlen(q, k8, v8, tables, torch.arange(len(lens) + 1), lens, d ** -0.5)
    ref = reference(q, dense_from_int8_cache(k8, True), dense_from_int8_cache(v8, False), tables, lens, d ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2.5e-2, rtol=0)
    # And near attention over the unquantized cache (bf16), which is what it stands in for.
    bf16 = k.paged_attention_varlen(q, kc.bfloat16(), vc.bfloat16(), tables, torch.arange(len(lens) + 1), lens,
                                    d ** -0.5)
    assert (out.float() - bf16.float()).abs().mean() < 0.01


def test_int8_attention_same_bits_as_prefill_chunk_or_decode(k):
    """A token's output over an int8 cache is the same whether its request is computed as
    one prompt chunk, in chunks beside another request, or one token at a time."""
    g = torch.Generator().manual_seed(5)
    hkv, hq, d, bs, nb = 3, 9, 64, 16, 40
    kc = int8_cache_from_dense(torch.randn(hkv, nb, bs, d, generator=g), True)
    vc = int8_cache_from_dense(torch.randn(hkv, nb, bs, d, generator=g), False)
    L = 45
    blocks, other = torch.randperm(nb, generator=g)[:3], torch.randperm(nb, generator=g)[:3]
    q = torch.randn(L, hq, d, generator=g).bfloat16()
    qb = torch.randn(7, hq, d, generator=g).bfloat16()

    def call(q_rows, starts, lens, tables):
        return k.paged_attention_varlen(q_rows.contiguous(), kc, vc, torch.stack(tables), torch.tensor(starts),
                                        torch.tensor(lens), d ** -0.5)

    whole = call(q, [0, L], [L], [blocks])
    for lo, hi in ((0, 17), (17, 33), (33, 45)):
        out = call(torch.cat([qb, q[lo:hi]]), [0, 7, 7 + hi - lo], [30, hi], [other, blocks])
        assert torch.equal(out[7:], whole[lo:hi])
    for t in range(L):
        out = call(torch.cat([q[t:t + 1], qb[:1]]), [0, 1, 2], [t + 1, 11], [blocks, other])
        assert torch.equal(out[0], whole[t])


def test_int8_cache_rejects_bad_shapes(k):
    q = torch.randn(1, 2, 64).bfloat16()
    bad_block = torch.zeros(1, 4, 8, 68, dtype=torch.uint8)  # blocks of 8 tokens
    with pytest.raises(RuntimeError, match="multiple of 16"):
        k.paged_attention_varlen(q, bad_block, bad_block, torch.zeros(1, 1, dtype=torch.long), torch.tensor([0, 1]),
                                 torch.tensor([1]), 0.125)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        k.paged_attention_varlen(q.float(), torch.zeros(1, 4, 16, 68, dtype=torch.uint8),
                                 torch.zeros(1, 4, 16, 68, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.long),
                                 torch.tensor([0, 1]), torch.tensor([1]), 0.125)


def test_sliding_window_over_int8_cache_matches_float64(k):
    """A sliding-window layer over an int8 cache: each row attends its last `window`
    (dequantized) keys, within int8's tolerance, and a window past the context changes nothing."""
    g = torch.Generator().manual_seed(11)
    hkv, group, d, bs, nb, window = 2, 2, 64, 16, 64, 20
    kc, vc = torch.randn(hkv, nb, bs, d, generator=g), torch.randn(hkv, nb, bs, d, generator=g)
    k8, v8 = int8_cache_from_dense(kc, True), int8_cache_from_dense(vc, False)
    lens = torch.tensor([1, 19, 20, 21, 63, 100])
    nblk = int((lens.max() + bs - 1) // bs)
    tables = torch.stack([torch.randperm(nb, generator=g)[:nblk] for _ in lens])
    q = torch.randn(len(lens), hkv * group, d, generator=g).bfloat16()
    args = (tables, torch.arange(len(lens) + 1), lens, d ** -0.5)
    out = k.paged_attention_varlen(q, k8, v8, *args, window=window)
    kd, vd = dense_from_int8_cache(k8, True), dense_from_int8_cache(v8, False)
    ref = []
    for i, n in enumerate(lens.tolist()):
        s = max(0, n - window)
        kk = kd[:, tables[i]].reshape(hkv, -1, d)[:, s:n].double()
        vv = vd[:, tables[i]].reshape(hkv, -1, d)[:, s:n].double()
        p = torch.softmax(q[i].double().view(hkv, -1, d) @ kk.transpose(-1, -2) * d ** -0.5, -1)
        ref.append((p @ vv).reshape(-1, d))
    torch.testing.assert_close(out.double(), torch.stack(ref), atol=2.5e-2, rtol=0)
    assert torch.equal(k.paged_attention_varlen(q, k8, v8, *args, window=1000), k.paged_attention_varlen(q, k8, v8, *args))
