"""The batch-invariant kernels: right answers, and a row's bits independent of its batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sluice.lora.slots import output_blocks


@pytest.fixture
def k(isa_kernels):
    """Each build of the kernels this CPU runs (conftest.KERNEL_ISAS)."""
    return isa_kernels


def row_slices(m: int):
    """(start, rows) windows of an m-row batch: alone, in small and odd-sized batches."""
    return [(s, n) for n in (1, 2, 3, 4, 5, 7, 8, 9, 17) for s in (0, 1, m - n) if s + n <= m]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,kdim,bias", [(96, 64, False), (37, 7, True), (200, 131, True), (1024, 576, False)])
def test_linear_matches_reference_and_is_row_invariant(k, dtype, n, kdim, bias):
    g = torch.Generator().manual_seed(n * kdim)
    w = torch.randn(n, kdim, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    x = torch.randn(70, kdim, generator=g).to(dtype)
    packed = k.bi_pack_weight(w)
    full = k.bi_linear(x, packed, n, b)
    assert full.dtype == dtype and full.shape == (70, n)
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    tol = (2e-2 if dtype == torch.bfloat16 else 1e-5) * ref.abs().max().item()
    torch.testing.assert_close(full.float(), ref, atol=tol, rtol=0)
    for s, m in row_slices(70):
        assert torch.equal(k.bi_linear(x[s:s + m], packed, n, b), full[s:s + m]), (s, m)
    # Float32 logits from bf16 inputs (the LM head) are invariant too.
    logits = k.bi_linear(x, packed, n, b, True)
    assert logits.dtype == torch.float32
    assert torch.equal(k.bi_linear(x[5:6], packed, n, b, True), logits[5:6])


def test_int8_linear_matches_reference_and_is_row_invariant(k):
    """int8 weights (widened to bf16 in registers, the column scale after the sum)."""
    g = torch.Generator().manual_seed(3)
    n, kdim = 200, 131
    q = torch.randint(-127, 128, (n, kdim), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    x = torch.randn(70, kdim, generator=g).to(torch.bfloat16)
    packed = k.bi_pack_weight_int8(q)
    full = k.bi_linear_int8(x, packed, scale, n, None, True)
    ref = x.float() @ (q.float() * scale[:, None]).T
    torch.testing.assert_close(full, ref, atol=1e-3 * ref.abs().max().item(), rtol=0)
    for s, m in row_slices(70):
        assert torch.equal(k.bi_linear_int8(x[s:s + m], packed, scale, n, None, True), full[s:s + m]), (s, m)


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per block of 32 k (scale max|x| / 127, round half to even), as
    the w8a8 and w4a8 kernels do, dequantized in float64."""
    m, kdim = x.shape
    kp = (kdim + 31) // 32 * 32
    blocks = F.pad(x.float(), (0, kp - kdim)).reshape(m, -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    xq = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0)).clamp(-127, 127)
    return (xq.double() * (amax / 127).double()).reshape(m, kp)[:, :kdim]


def w8a8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias=None) -> torch.Tensor:
    """x quantized per block of 32 times the int8 weights and their column scales, in float64."""
    y = quantized_activations(x) @ (q.double() * scale.double()[:, None]).T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("n,kdim,bias", [(200, 131, True), (48, 576, False), (576, 1536, False), (37, 7, True)])
def test_w8a8_linear_matches_reference_and_is_row_invariant(k, n, kdim, bias):
    """int8 x int8 (w8a8): activations quantized per block of 32 inside the kernel."""
    g = torch.Generator().manual_seed(n + kdim)
    q = torch.randint(-127, 128, (n, kdim), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(70, kdim, generator=g)
    x[:, kdim // 2] *= 50  # an outlier channel: its block's scale must not touch the others
    x = x.to(torch.bfloat16)
    packed = k.w8a8_pack_weight(q)
    full = k.w8a8_linear(x, packed, scale, n, b, True)
    ref = w8a8_reference(x, q, scale, b)
    # Rounding ties may fall either way (one quantum of one element); anything wrong in the
    # packing, offsets or scales is off by far more.
    quantum = (x.float().abs().amax() / 127 * (q.float().abs() * scale[:, None]).amax()).item()
    assert (full.double() - ref).abs().max().item() < 1.01 * quantum
    assert (full.double() - ref).abs().median().item() < 1e-4 * ref.abs().max().item()
    bf16 = k.w8a8_linear(x, packed, scale, n, b)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, full.to(torch.bfloat16))
    for s, m in row_slices(70):
        assert torch.equal(k.w8a8_linear(x[s:s + m], packed, scale, n, b, True), full[s:s + m]), (s, m)


def w4a8_reference(x: torch.Tensor, q: torch.Tensor, d: torch.Tensor, mn: torch.Tensor, bias=None) -> torch.Tensor:
    """x quantized per block of 32 times the 4-bit weights d * q + m, in float64."""
    kdim = x.shape[1]
    kp = (kdim + 31) // 32 * 32
    qb = F.pad(q.double(), (0, kp - kdim)).reshape(q.shape[0], -1, 32)
    w = (qb * d.double()[..., None] + mn.double()[..., None]).reshape(q.shape[0], kp)[:, :kdim]
    y = quantized_activations(x) @ w.T
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("n,kdim,bias", [(200, 131, True), (48, 576, False), (576, 1536, False), (37, 7, True)])
def test_w4a8_linear_matches_reference_and_is_row_invariant(k, n, kdim, bias):
    """4-bit weights (a scale and a minimum per block of 32) x int8 activations, 15 and
    127 (the int16 sums' edge) included."""
    from sluice.quantization.w4a8 import quantize_4bit
    g = torch.Generator().manual_seed(n + kdim)
    w = torch.randn(n, kdim, generator=g) * 0.05 + 0.01
    q, d, mn = quantize_4bit(w)
    q[:, : kdim // 2] = 15  # every pair at 2 * 15 * 127 where x sits at +-127 below
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(70, kdim, generator=g)
    x[:, kdim // 2] *= 50  # an outlier channel: its block's scale must not touch the others
    x[:3, : kdim // 2] = 4.0
    x[3:5, : kdim // 2] = -4.0
    x = x.to(torch.bfloat16)
    packed, pd, pm = k.w4a8_pack_weight(q, d, mn)
    full = k.w4a8_linear(x, packed, pd, pm, n, b, True)
    ref = w4a8_reference(x, q, d, mn, b)
    quantum = (x.float().abs().amax() / 127 * (d.abs() * 15 + mn.abs()).amax()).item()
    assert (full.double() - ref).abs().max().item() < 1.01 * quantum
    assert (full.double() - ref).abs().median().item() < 1e-4 * ref.abs().max().item()
    assert (full.double() - ref)[:5].abs().max().item() < 1e-4 * ref[:5].abs().max().item()  # the edge rows
    bf16 = k.w4a8_linear(x, packed, pd, pm, n, b)
    assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, full.to(torch.bfloat16))
    for s, m in row_slices(70):
        assert torch.equal(k.w4a8_linear(x[s:s + m], packed, pd, pm, n, b, True), full[s:s + m]), (s, m)
    # The nibble-packed copy (two weights a byte), which steps of few rows read (every step on
    # the AVX-512 build, whose byte layout may then be empty): the same bits at every count.
    nibbles = k.w4a8_pack_nibbles(packed)
    assert nibbles.numel() * 2 == packed.numel()
    for m in (1, 2, 3, 4, 5, 8, 9, 16, 70):
        got = k.w4a8_linear(x[:m], packed, pd, pm, n, b, True, nibbles)
        assert torch.equal(got, full[:m]), m
        # Without the byte layout (quantization='gguf' keeps none), nibbles at every count.
        assert torch.equal(k.w4a8_linear(x[:m], packed.new_empty(0), pd, pm, n, b, True, nibbles), full[:m]), m


@pytest.mark.parametrize("n,kdim,bias", [(200, 128, True), (37, 640, False)])
def test_wide_block_weights_match_reference_and_are_row_invariant(k, n, kdim, bias):
    """Block weights wider than 4 bits (a GGUF's Q5/Q8 blocks, quantization='gguf'): q up
    to 254 (the plain AVX2 build's sign trick, 254 - 127 by +-127), Q8_0's m = -127 d and
    Q5_0's -16 d in one matrix; w4a8_rows reads back exactly d * q + m."""
    g = torch.Generator().manual_seed(n + kdim)
    q = torch.randint(0, 255, (n, kdim), generator=g, dtype=torch.uint8)
    q[: n // 2, : kdim // 2] = 254
    q[n // 2:] &= 31
    d = torch.rand(n, kdim // 32, generator=g) * 0.002
    mn = torch.cat([-127 * d[: n // 2], -16 * d[n // 2:]])
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(70, kdim, generator=g)
    x[:3, : kdim // 2] = 4.0
    x[3:5, : kdim // 2] = -4.0
    x = x.to(torch.bfloat16)
    packed, pd, pm = k.w4a8_pack_weight(q, d, mn)
    assert packed.dtype == torch.int8  # the wide tag
    full = k.w4a8_linear(x, packed, pd, pm, n, b, True)
    ref = w4a8_reference(x, q, d, mn, b)
    quantum = (x.float().abs().amax() / 127 * (d.abs() * 254 + mn.abs()).amax()).item()
    assert (full.double() - ref).abs().max().item() < 1.01 * quantum
    assert (full.double() - ref).abs().median().item() < 1e-4 * ref.abs().max().item()
    assert (full.double() - ref)[:5].abs().max().item() < 1e-4 * ref[:5].abs().max().item()  # the edge rows
    for s, m in row_slices(70):
        assert torch.equal(k.w4a8_linear(x[s:s + m], packed, pd, pm, n, b, True), full[s:s + m]), (s, m)
    ids = torch.tensor([0, n - 1, n // 2, 5])
    values = (q.float().view(n, -1, 32) * d[..., None] + mn[..., None]).view(n, kdim)
    assert torch.equal(k.w4a8_rows(ids, packed, pd, pm, kdim), values[ids])
    # Symmetric rows without their minimums: one -offset per row, the same bits.
    offsets = torch.cat([torch.full((n // 2,), -127.0), torch.full((n - n // 2,), -16.0)])
    packed2, pd2, pm2 = k.w4a8_pack_weight(q, d, offsets)
    assert pm2.numel() < pm.numel()
    assert torch.equal(k.w4a8_linear(x, packed2, pd2, pm2, n, b, True), full)
    assert torch.equal(k.w4a8_linear(x[:3], packed2, pd2, pm2, n, b, True), full[:3])
    assert torch.equal(k.w4a8_rows(ids, packed2, pd2, pm2, kdim), values[ids])


@pytest.mark.parametrize("n,kdim,bias", [(200, 512, True), (37, 256, False)])
def test_q6k_weights_match_reference_and_are_row_invariant(k, n, kdim, bias):
    """Q6_K in its own form (q6k.cpp): q in 0..63 at both ends, int8 scales per 16 k at
    -128 and 127, through the w4a8 entry points; w4a8_rows reads back ggml's values."""
    from sluice.quantization.gguf_blocks import Q6KBlocks
    g = torch.Generator().manual_seed(n + kdim)
    q = torch.randint(0, 64, (n, kdim), generator=g, dtype=torch.uint8)
    q[: n // 2, : kdim // 2] = 63
    q[n // 2:, : kdim // 4] = 0
    sc = torch.randint(-128, 128, (n, kdim // 16), generator=g, dtype=torch.int8)
    sc[0], sc[1] = -128, 127
    d = (torch.rand(n, kdim // 256, generator=g) * 1e-4).half().float()
    blocks = Q6KBlocks(q, sc, d)
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(70, kdim, generator=g)
    x[:3, : kdim // 2] = 4.0
    x[3:5, : kdim // 2] = -4.0
    x = x.to(torch.bfloat16)
    low, top, psc, pd = k.q6k_pack_weight(q, sc, d)
    assert low.numel() + top.numel() == -(-n // 16) * 16 * kdim * 6 // 8  # 6 bits a weight
    full = k.w4a8_linear(x, low, pd, psc, n, b, True, top)
    ref = quantized_activations(x) @ blocks.values().double().T + (0 if b is None else b.double())
    err = (full.double() - ref).abs()
    # A quantum or two apart where an activation's rounding went the other way, else float32's.
    assert err.max().item() < 2.01 * (x.float().abs().amax() / 127 * blocks.values().abs().amax()).item()
    assert err.median().item() < 1e-5 * ref.abs().max().item()
    assert err[:5].max().item() < 1e-5 * ref[:5].abs().max().item()  # the edge rows
    for s, m in row_slices(70):
        assert torch.equal(k.w4a8_linear(x[s:s + m], low, pd, psc, n, b, True, top), full[s:s + m]), (s, m)
    assert torch.equal(k.w4a8_linear(x[:4], low, pd, psc, n, b, False, top), full[:4].to(torch.bfloat16))
    ids = torch.tensor([0, n - 1, n // 2, 5])
    assert torch.equal(k.w4a8_rows(ids, low, pd, psc, kdim, top), blocks.values()[ids])
    with pytest.raises(RuntimeError, match="0..63"):
        k.q6k_pack_weight(q | 64, sc, d)
    with pytest.raises(RuntimeError, match="256"):
        k.q6k_pack_weight(q[:, :128], sc[:, :8], d[:, :0])


@pytest.mark.parametrize("n,kdim,symmetric", [(200, 640, True), (37, 100, False)])
def test_5bit_block_weights_give_the_byte_forms_bits(k, n, kdim, symmetric):
    """q up to 31 (Q5_0, Q5_1, Q5_K) packed at 5 bits a weight (w4a8_pack_5bit): the same
    bits as the same blocks in the byte form, at every row count; rows read back exactly."""
    g = torch.Generator().manual_seed(n + kdim)
    nblk = -(-kdim // 32)
    q = torch.randint(0, 32, (n, kdim), generator=g, dtype=torch.uint8)
    q[0], q[1] = 31, 0
    d = torch.rand(n, nblk, generator=g) * 0.01
    mn = -16 * d if symmetric else -torch.rand(n, nblk, generator=g) * 0.1
    x = torch.randn(70, kdim, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g)
    five = k.w4a8_pack_5bit(q, d, torch.full((n,), -16.0) if symmetric else mn)
    assert five[0].dim() == 5 and five[0].numel() == -(-n // 16) * 16 * nblk * 32 * 5 // 8
    full = k.w4a8_linear(x, *five, n, b, True)
    assert torch.equal(full, k.w4a8_linear(x, *k.w4a8_pack_weight(q, d, mn), n, b, True))
    for s, m in row_slices(70):
        assert torch.equal(k.w4a8_linear(x[s:s + m], *five, n, b, True), full[s:s + m]), (s, m)
    values = (F.pad(q.float(), (0, nblk * 32 - kdim)).view(n, nblk, 32) * d[..., None] + mn[..., None])
    ids = torch.tensor([0, n - 1, 1, 5])
    assert torch.equal(k.w4a8_rows(ids, *five, kdim), values.view(n, -1)[:, :kdim][ids])
    with pytest.raises(RuntimeError, match="0..31"):
        k.w4a8_pack_5bit(q | 32, d, mn)


def test_block_rows_read_back_4bit_weights_from_either_layout(k):
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 16, (40, 96), generator=g, dtype=torch.uint8)
    d, mn = torch.rand(40, 3, generator=g), -torch.rand(40, 3, generator=g)
    packed, pd, pm = k.w4a8_pack_weight(q, d, mn)
    values = (q.float().view(40, 3, 32) * d[..., None] + mn[..., None]).view(40, 96)
    ids = torch.tensor([39, 0, 17, 17])
    assert torch.equal(k.w4a8_rows(ids, packed, pd, pm, 96), values[ids])
    nibbles = k.w4a8_pack_nibbles(packed)
    assert torch.equal(k.w4a8_rows(ids, packed.new_empty(0), pd, pm, 96, nibbles), values[ids])


@pytest.mark.parametrize("n,kdim,bias", [(200, 131, True), (576, 1536, False)])
def test_float16_block_scales_give_the_float32_bits(k, n, kdim, bias):
    """A Q4_1 file's scales and minimums are float16 values; kept as float16
    (w4a8_half_scales) the nibble path reads half the scale bytes and computes the same
    float32 products: the same bits at every row count, and w4a8_rows reads the same values.
    Scales that are not all float16 values stay float32."""
    g = torch.Generator().manual_seed(n * 3 + kdim)
    nblk = -(-kdim // 32)
    q = torch.randint(0, 16, (n, kdim), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, nblk, generator=g) * 0.01).half().float()
    mn = (-torch.rand(n, nblk, generator=g) * 0.1).half().float()
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(40, kdim, generator=g).to(torch.bfloat16)
    packed, pd, pm = k.w4a8_pack_weight(q, d, mn)
    nibbles = k.w4a8_pack_nibbles(packed)
    hd, hm = k.w4a8_half_scales(pd, pm)
    assert hd.dtype == torch.float16 and torch.equal(hd.float(), pd) and torch.equal(hm.float(), pm)
    empty = packed.new_empty(0)
    for m in (1, 2, 3, 4, 5, 8, 9, 40):
        want = k.w4a8_linear(x[:m], empty, pd, pm, n, b, True, nibbles)
        assert torch.equal(k.w4a8_linear(x[:m], empty, hd, hm, n, b, True, nibbles), want), m
    # Where the byte layout stays (the AVX2 builds' bigger steps read it with float32 scales),
    # the nibbles take their own float16 copy: the same bits again, at every row count.
    both = torch.stack((hd, hm)).contiguous()
    for m in (1, 2, 4, 5, 8, 9, 40):
        assert torch.equal(k.w4a8_linear(x[:m], packed, pd, pm, n, b, True, nibbles, both),
                           k.w4a8_linear(x[:m], packed, pd, pm, n, b, True, nibbles)), m
    ids = torch.tensor([n - 1, 0, 17, 17])
    assert torch.equal(k.w4a8_rows(ids, empty, hd, hm, kdim, nibbles), k.w4a8_rows(ids, empty, pd, pm, kdim, nibbles))
    assert k.w4a8_half_scales(pd + 1e-9, pm) is None      # not float16 values: kept as they are
    with pytest.raises(RuntimeError, match="float16 ones only with nibbles"):
        k.w4a8_linear(x[:1], packed, hd, hm, n, b, True)  # the byte layout reads float32 scales


def test_quantize_4bit_finds_q4_1_values_again():
    """Values made as llama.cpp's Q4_1 stores them (f16 scale and minimum, q in 0..15, every
    block reaching 0 and 15), rounded to bf16: the same q, and scales within bf16 rounding."""
    from sluice.quantization.w4a8 import quantize_4bit
    g = torch.Generator().manual_seed(0)
    n, kdim = 64, 96
    q = torch.randint(0, 16, (n, kdim), generator=g, dtype=torch.uint8)
    q[:, ::32] = 0
    q[:, 1::32] = 15
    d = (torch.rand(n, kdim // 32, generator=g) * 0.01 + 1e-3).half().float()
    mn = (-d * 7.5 + torch.randn(n, kdim // 32, generator=g) * 1e-3).half().float()
    w = (q.float().view(n, -1, 32) * d[..., None] + mn[..., None]).view(n, kdim).to(torch.bfloat16)
    q2, d2, mn2 = quantize_4bit(w)
    assert torch.equal(q2, q)
    torch.testing.assert_close(d2, d, rtol=2e-2, atol=0)


def test_block_packing_takes_wide_values_and_refuses_255(k):
    """Past 15 the weights pack wide (a byte each, tagged int8); 255 has no place in the
    plain AVX2 build's q - 127 form, so no build takes it; per-row offsets only for wide."""
    q = torch.zeros(16, 32, dtype=torch.uint8)
    assert k.w4a8_pack_weight(q, torch.ones(16, 1), torch.zeros(16, 1))[0].dtype == torch.uint8
    with pytest.raises(RuntimeError, match="wide weights"):
        k.w4a8_pack_weight(q, torch.ones(16, 1), torch.zeros(16))
    q[3, 5] = 16
    assert k.w4a8_pack_weight(q, torch.ones(16, 1), torch.zeros(16, 1))[0].dtype == torch.int8
    q[3, 5] = 255
    with pytest.raises(RuntimeError, match="0..254"):
        k.w4a8_pack_weight(q, torch.ones(16, 1), torch.zeros(16, 1))


def test_w8a8_extreme_values_and_range(k):
    """Weights and activations at +-127 (the sign trick's and vpdpbusd's edges) sum exactly;
    -128, which the AVX2 build's vpsignb cannot negate, is refused at packing."""
    kdim, n = 96, 32
    q = torch.full((n, kdim), 127, dtype=torch.int8)
    q[::2] = -127
    q[:, ::3] *= -1
    x = torch.ones(5, kdim, dtype=torch.bfloat16)
    x[:, 1::2] = -1
    y = k.w8a8_linear(x, k.w8a8_pack_weight(q), torch.ones(n), n, None, True)
    ref = (x.float().sign() * 127) @ q.float().T / 127  # x quantizes to +-127, scale 1 / 127
    assert torch.allclose(y, ref, rtol=0, atol=1e-3)
    bad = q.clone()
    bad[3, 5] = -128
    with pytest.raises(RuntimeError, match="-127..127"):
        k.w8a8_pack_weight(bad)


def test_torch_matmul_is_not_row_invariant():
    """Why the kernels exist: the library matmul's result for a row changes with the batch."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g)
    x = torch.randn(256, 576, generator=g)
    full = x @ w.T
    assert any(not torch.equal((x[:m] @ w.T)[0], full[0]) for m in (1, 2, 3, 8, 16, 33, 64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_and_silu_and_mul(k, dtype):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 3, 72, generator=g) * 3).to(dtype)   # leading dims flattened, 72 = 4.5 vectors
    w = torch.randn(72, generator=g).to(dtype)
    y = k.bi_rms_norm(x, w, 1e-5)
    xf = x.float()
    ref = w.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).float()
    torch.testing.assert_close(y.float(), ref, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    for s, m in row_slices(40):
        assert torch.equal(k.bi_rms_norm(x[s:s + m], w, 1e-5), y[s:s + m])

    # float32 weights under bf16 rows (Gemma's 1 + w): the product rounded once.
    w32 = 1 + torch.randn(72, generator=g) * 0.3
    y = k.bi_rms_norm(x, w32, 1e-5)
    want = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * w32).to(dtype)
    torch.testing.assert_close(y.float(), want.float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    if dtype == torch.bfloat16:  # at most one bf16 step from the once-rounded product
        assert ((y.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()
    summed, _ = k.bi_add_rms_norm(x, x, w32, 1e-5)
    assert torch.equal(summed, k.bi_rms_norm((x.float() + x.float()).to(dtype), w32, 1e-5))
    for s, m in row_slices(40):
        assert torch.equal(k.bi_rms_norm(x[s:s + m], w32, 1e-5), y[s:s + m])

    gu = torch.randn(40, 2 * 100, generator=g).to(dtype)
    y = k.bi_silu_and_mul(gu)
    gate, up = gu.float().chunk(2, dim=-1)
    torch.testing.assert_close(y.float(), F.silu(gate) * up, atol=3e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=1e-2)
    for s, m in row_slices(40):
        assert torch.equal(k.bi_silu_and_mul(gu[s:s + m]), y[s:s + m])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_varlen_attention_same_bits_as_prefill_chunk_or_decode(k, dtype):
    """A token's attention output is the same whether its request is computed as one prompt
    chunk, in several chunks, or one token at a time, and whatever other requests share the
    call; and it equals dense causal attention."""
    g = torch.Generator().manual_seed(2)
    hkv, hq, d, bs, nb = 2, 6, 64, 4, 40
    kc = torch.randn(hkv, nb, bs, d, generator=g).to(dtype)
    vc = torch.randn(hkv, nb, bs, d, generator=g).to(dtype)
    L = 23
    blocks = torch.randperm(nb, generator=g)[:6]       # request A's blocks, scattered
    q = torch.randn(L, hq, d, generator=g).to(dtype)
    scale = d ** -0.5

    def call(q_rows, starts, lens, tables):
        return k.paged_attention_varlen(q_rows.contiguous(), kc, vc, torch.stack(tables),
                                        torch.tensor(starts), torch.tensor(lens), scale)

    whole = call(q, [0, L], [L], [blocks])
    # Dense reference from the same cached K/V.
    kd = kc[:, blocks].reshape(hkv, -1, d)[:, :L].repeat_interleave(hq // hkv, 0).float()
    vd = vc[:, blocks].reshape(hkv, -1, d)[:, :L].repeat_interleave(hq // hkv, 0).float()
    ref = F.scaled_dot_product_attention(q.transpose(0, 1).float(), kd, vd, is_causal=True, scale=scale)
    torch.testing.assert_close(whole.float(), ref.transpose(0, 1), atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               rtol=0)
    # Chunks of 9, 9, 5, each beside a neighbour request B of another length.
    other = torch.randperm(nb, generator=g)[:6]
    qb = torch.randn(7, hq, d, generator=g).to(dtype)
    for lo, hi in ((0, 9), (9, 18), (18, 23)):
        out = call(torch.cat([qb, q[lo:hi]]), [0, 7, 7 + hi - lo], [19, hi], [other, blocks])
        assert torch.equal(out[7:], whole[lo:hi])
    # Token by token, as decodes, in a batch with B's decode.
    for t in range(L):
        out = call(torch.cat([q[t:t + 1], qb[:1]]), [0, 1, 2], [t + 1, 11], [blocks, other])
        assert torch.equal(out[0], whole[t])


def test_thread_count_does_not_change_bits(k):
    """Threads split output columns and rows, never a reduction: same bits on 1 or 2."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(640, 576, generator=g).bfloat16()
    x = torch.randn(9, 576, generator=g).bfloat16()
    packed = k.bi_pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (k.bi_linear(x, packed, 640), k.bi_rms_norm(x, w[0], 1e-6))
        torch.set_num_threads(2)
        two = (k.bi_linear(x, packed, 640), k.bi_rms_norm(x, w[0], 1e-6))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_deltas_alone_and_in_a_batch(isa_kernels, dtype):
    """lora.cpp: a row's delta is the same bits alone as among rows of its own and other
    adapters, and it is B @ (A @ x) (float64 reference, the middle in the model dtype)."""
    k = isa_kernels
    g = torch.Generator().manual_seed(3)
    kdim, n, cap = 96, 150, 32
    at = torch.zeros(3, kdim, cap, dtype=dtype)
    b = torch.zeros(3, n, cap, dtype=dtype)  # B [out, rank] per slot
    ranks = torch.tensor([32, 8, 20], dtype=torch.int32)
    for s, r in enumerate(ranks.tolist()):
        at[s, :, :r] = torch.randn(kdim, r, generator=g).to(dtype)
        b[s, :, :r] = (torch.randn(n, r, generator=g) * 0.1).to(dtype)
    bt = torch.stack([output_blocks(b[s]) for s in range(3)])
    x = torch.randn(13, kdim, generator=g).to(dtype)
    y = torch.randn(13, n, generator=g).to(dtype)
    row_slot = torch.tensor([0, 1, 2, 0, 0, 1, 2, 2, 2, 0, 1, -1, 0], dtype=torch.int32)
    batch = y.clone()
    k.lora_sgmv(batch, x, at, bt, ranks, row_slot)
    for t in range(13):
        alone = y[t:t + 1].clone()
        k.lora_sgmv(alone, x[t:t + 1].contiguous(), at, bt, ranks, row_slot[t:t + 1].contiguous())
        assert torch.equal(alone[0], batch[t]), t
        s = int(row_slot[t])
        if s < 0:
            assert torch.equal(batch[t], y[t])
            continue
        r = int(ranks[s])
        mid = (at[s, :, :r].double().t() @ x[t].double()).to(dtype).double()
        want = y[t].double() + b[s, :, :r].double() @ mid
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        assert torch.allclose(batch[t].double(), want, rtol=tol, atol=tol * want.abs().max().item()), t
