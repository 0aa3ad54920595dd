"""The kernel builds per ISA: the lower builds (avx512_vnni, avx2_vnni, avx2) compute what
the best AVX-512 one does, bit for bit.

Every build compiles the same sources (backends/cpu/x86; avx2/avx512_on_avx2.h maps the
AVX-512 intrinsics onto AVX2, avx512/bf16_on_avx512.h BF16's onto AVX-512 F/BW), so every
op must give the same bits on the same inputs. Runs for each lower build the CPU executes
beside its best AVX-512 one (avx512_vnni and avx2 beside avx512 on a Zen 4, avx2 beside
avx512_vnni on an Ice Lake); an AVX2-only machine runs its builds through every other
kernel test instead.
"""
from __future__ import annotations

import pytest
import torch

from sluice.quantization.int8 import quantize_per_channel
from sluice.quantization.w4a8 import quantize_4bit
from sluice.backends.cpu import x86 as kernels
from sluice.lora.slots import output_blocks
from tests.conftest import ALL_KERNEL_ISAS, LOWER_ISAS as LOWER

pytestmark = pytest.mark.skipif(not LOWER, reason="needs a CPU that runs an AVX-512 build and a lower one")


@pytest.fixture(scope="module", params=LOWER or [None])
def builds(request):
    both = kernels.load(ALL_KERNEL_ISAS[0]), kernels.load(request.param)
    if None in both:
        pytest.skip("a kernel build failed here (see the log)")
    return both


def same(builds, fn):
    a, b = (fn(k) for k in builds)
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,n,kdim", [(1, 96, 64), (3, 37, 7), (9, 200, 131), (40, 576, 576)])
def test_linear_layers(builds, dtype, m, n, kdim):
    g = torch.Generator().manual_seed(m + n)
    w = torch.randn(n, kdim, generator=g)
    x = torch.randn(m, kdim, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    same(builds, lambda k: (k.bi_linear(x, k.bi_pack_weight(w.to(dtype)), n, b),
                            k.bi_linear(x, k.bi_pack_weight(w.to(dtype)), n, None, True)))
    if dtype == torch.bfloat16:
        q, scale = quantize_per_channel(w)
        same(builds, lambda k: (k.bi_linear_int8(x, k.bi_pack_weight_int8(q), scale, n, b),
                                k.w8a8_linear(x, k.w8a8_pack_weight(q), scale, n, b),
                                k.w8a8_linear(x, k.w8a8_pack_weight(q), scale, n, None, True)))
        q4 = quantize_4bit(w)
        same(builds, lambda k: (k.w4a8_linear(x, *k.w4a8_pack_weight(*q4), n, b),
                                k.w4a8_linear(x, *k.w4a8_pack_weight(*q4), n, None, True)))
        wide = torch.randint(0, 255, (n, kdim), generator=g, dtype=torch.uint8), q4[1], -127 * q4[1]
        same(builds, lambda k: (k.w4a8_linear(x, *k.w4a8_pack_weight(*wide), n, b),
                                k.w4a8_linear(x, *k.w4a8_pack_weight(*wide), n, None, True),
                                k.w4a8_linear(x, *k.w4a8_pack_weight(*wide[:2], torch.full((n,), -127.0)), n, b)))
        five = (wide[0] & 31, q4[1], -16 * q4[1])
        same(builds, lambda k: (k.w4a8_linear(x, *k.w4a8_pack_5bit(*five), n, b),
                                k.w4a8_linear(x, *k.w4a8_pack_5bit(*five[:2], torch.full((n,), -16.0)), n, None, True),
                                k.w4a8_rows(torch.arange(n), *k.w4a8_pack_5bit(*five), kdim)))


@pytest.mark.parametrize("m,n,kdim", [(1, 96, 256), (9, 37, 512), (40, 200, 768)])
def test_q6k_layers(builds, m, n, kdim):
    """Q6_K's own kernel (q6k.cpp) at its extremes: q 0 and 63, scales -128 and 127."""
    g = torch.Generator().manual_seed(m + n)
    q = torch.randint(0, 64, (n, kdim), generator=g, dtype=torch.uint8)
    q[0], q[1] = 63, 0
    sc = torch.randint(-128, 128, (n, kdim // 16), generator=g, dtype=torch.int8)
    sc[:, 0], sc[:, 1] = -128, 127
    d = (torch.rand(n, kdim // 256, generator=g) * 1e-3).half().float()
    x = torch.randn(m, kdim, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)

    def run(k):
        low, top, psc, pd = k.q6k_pack_weight(q, sc, d)
        return (k.w4a8_linear(x, low, pd, psc, n, b, False, top), k.w4a8_linear(x, low, pd, psc, n, None, True, top),
                k.w4a8_rows(torch.arange(n), low, pd, psc, kdim, top))
    same(builds, run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_norms_activation_and_rope(builds, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(21, 72, generator=g) * 3).to(dtype)
    r = torch.randn(21, 72, generator=g).to(dtype)
    w = torch.randn(72, generator=g).to(dtype)
    gu = torch.randn(21, 200, generator=g).to(dtype)
    same(builds, lambda k: (k.bi_rms_norm(x, w, 1e-5), *k.bi_add_rms_norm(x, r, w, 1e-5), k.bi_silu_and_mul(gu),
                            k.bi_rms_norm(x, w.float() + 1, 1e-5)))
    if dtype == torch.bfloat16:
        hq, hkv, d, nb, bs, t = 6, 2, 64, 8, 16, 37
        qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).bfloat16()
        ang = torch.randn(t, 1, d, generator=g)
        cos, sin = ang.cos().bfloat16(), ang.sin().bfloat16()
        slots = torch.randperm(nb * bs, generator=g)[:t]

        def rope(k):
            out = []
            for shape, cdtype in (((hkv, nb, bs, d), torch.bfloat16), ((hkv, nb, bs, d + 4), torch.uint8)):
                kc, vc = torch.zeros(shape, dtype=cdtype), torch.zeros(shape, dtype=cdtype)
                out += [k.rope_write_kv(qkv, cos, sin, kc, vc, slots, hq, hkv), kc, vc]
            return tuple(out)
        same(builds, rope)


@pytest.mark.parametrize("cache", ["bfloat16", "float32", "int8"])
@pytest.mark.parametrize("group,d", [(3, 64), (2, 128), (1, 32)])
def test_paged_attention(builds, cache, group, d):
    from sluice.backends.kv_int8 import int8_cache_from_dense
    g = torch.Generator().manual_seed(group * d)
    hkv, nb, bs = 2, 24, 16
    dtype = torch.float32 if cache == "float32" else torch.bfloat16
    kd, vd = torch.randn(hkv, nb, bs, d, generator=g), torch.randn(hkv, nb, bs, d, generator=g)
    if cache == "int8":
        kc, vc = int8_cache_from_dense(kd, True), int8_cache_from_dense(vd, False)
    else:
        kc, vc = kd.to(dtype), vd.to(dtype)
    # Two requests: a prompt chunk of 30 tokens after 50 cached ones, and a decode.
    tables = torch.stack([torch.randperm(nb, generator=g)[:6] for _ in range(2)])
    q = torch.randn(31, hkv * group, d, generator=g).to(dtype)
    starts, lens = torch.tensor([0, 30, 31]), torch.tensor([80, 71])
    same(builds, lambda k: k.paged_attention_varlen(q, kc, vc, tables, starts, lens, d ** -0.5))
    if cache != "int8":
        same(builds, lambda k: k.paged_decode_attention(q[:2].contiguous(), kc, vc, tables, lens, d ** -0.5))


def test_argmax_and_greedy_head(builds):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 3001, generator=g)
    logits[2, 17] = float("nan")
    vocab, hidden = 3000, 97
    w = (torch.randn(vocab, hidden, generator=g) * 0.05).bfloat16()
    x = torch.randn(9, hidden, generator=g).bfloat16()
    q, scale = quantize_per_channel(w)

    def head(k):
        approx = k.w8a8_linear(x, k.w8a8_pack_weight(q), scale, vocab, None, True)
        approx7 = k.head_w8a7(x, k.head_w8a7_pack(q), scale.float(), vocab)
        return k.argmax_rows(logits), approx, k.greedy_head(approx, x, k.bi_pack_weight(w), 16), approx7
    same(builds, head)


def test_sample_rows(builds):
    """sample.cpp: 256 rows of a 3,001-token vocabulary (a scalar tail), a spread of u, with
    and without top-k, top-p and min-p, greedy rows among them."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 256, 3001
    x = torch.randn(n, vocab, generator=g) * 4
    u = torch.rand(n, generator=g, dtype=torch.float64)
    temperature = torch.rand(n, generator=g) * 1.5
    temperature[::7] = 0.0
    top_k = torch.randint(1, vocab + 1, (n,), generator=g)
    top_p = torch.rand(n, generator=g).clamp(min=0.05)
    min_p = torch.rand(n, generator=g) * 0.2

    def run(k):
        return k.sample_rows(x, temperature, u), k.sample_rows(x, temperature, u, top_k, top_p, min_p)
    same(builds, run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_deltas(builds, dtype):
    """lora.cpp: ranks 16-48 in a stack of 48, one slot that does not adapt the layer, an
    output count that is no multiple of 16 (the scalar tail)."""
    g = torch.Generator().manual_seed(7)
    m, kdim, n, rank = 11, 70, 83, 48
    at = torch.randn(4, kdim, rank, generator=g).to(dtype)
    bt = torch.stack([output_blocks(torch.randn(n, rank, generator=g)) for _ in range(4)]).to(dtype)
    ranks = torch.tensor([48, 16, 0, 33], dtype=torch.int32)
    x = torch.randn(m, kdim, generator=g).to(dtype)
    y = torch.randn(m, n, generator=g).to(dtype)
    row_slot = torch.tensor([0, 1, -1, 3, 3, 0, 2, 1, 0, 0, 3], dtype=torch.int32)

    def run(k):
        out = y.clone()
        k.lora_sgmv(out, x, at, bt, ranks, row_slot)
        return out
    same(builds, run)
