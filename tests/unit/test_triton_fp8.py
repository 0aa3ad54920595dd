"""FP8 on the CUDA backend's Triton kernels against torch references, on small shapes: the
e4m3 rounding (saturation, zeros, subnormals), activations quantized per token, the
split-K GEMV over bf16 / float32 / FP8 weights (odd row counts, K not a multiple of the
tile, several splits), the FP8 linear method on both of its paths, the FP8 KV cache's
write and both attention kernels reading it. Under Triton's interpreter on CPU tensors
without a GPU (tests/conftest.py), compiled on one."""
from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from sluice.backends import kv_fp8  # noqa: E402
from sluice.backends.cuda import attention as ta  # noqa: E402
from sluice.backends.cuda import fp8  # noqa: E402
from sluice.backends.cuda.gemv import GemvConfig, default_config, gemv  # noqa: E402
from tests.unit.test_triton_kernels import DEVICE, make_batch, ref_attention  # noqa: E402

GPU = torch.cuda.is_available()
FP8 = torch.float8_e4m3fn


def assert_fp8_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal values under the interpreter (the same rounding as torch's); on a GPU, whose
    float32 division is not correctly rounded, within one e4m3 step."""
    g, w = got.float().cpu(), want.float().cpu()
    if not GPU:
        assert torch.equal(g, w), (g - w).abs().max()
    else:
        assert ((g - w).abs() <= w.abs() / 8 + 2 ** -9).all()


def test_activation_rows_round_as_torch_does():
    torch.manual_seed(0)
    x = torch.randn(6, 300) * torch.tensor([1.0, 1e-3, 50.0, 1.0, 1.0, 1.0])[:, None]
    x[3] = 0.0                          # a zero row: q 0, a tiny positive scale
    x[4, :] = 1e-4
    x[4, 7] = 30.0                      # one large value: the others fall into e4m3's subnormals
    x[5, ::2] *= -1
    q, s = fp8.quantize_rows(x.to(DEVICE))
    want_q, want_s = fp8.quantize_rows_reference(x)
    assert q.dtype == FP8 and s.dtype == torch.float32
    assert_fp8_close(q, want_q)
    assert torch.allclose(s.cpu(), want_s)
    assert (s > 0).all() and q[3].float().abs().max() == 0
    assert q.float().abs().max() == 448.0           # each row's largest value maps to 448
    assert (q.float().cpu() * s.cpu()[:, None] - x).abs().max() <= x.abs().max() / 16


def test_e4m3_saturates_and_keeps_zero_and_sign():
    """Values past 448 (a checkpoint's scale or a clamp upstream) saturate instead of
    becoming NaN; the rounding is torch's half-to-even, subnormals included."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(X, Y, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        ok = i < n
        x = tl.load(X + i, mask=ok, other=0.0)
        y = fp8.e4m3_round(tl.minimum(tl.maximum(x, -448.0), 448.0))
        tl.store(Y + i, y.to(Y.dtype.element_ty), mask=ok)

    x = torch.tensor([500.0, -1e6, 448.0, 464.0, 0.0, -0.0, 1e-9, 2 ** -10, 3 * 2 ** -10, 2 ** -9, 240.0, 232.0,
                      248.0, 0.0137, -17.5, 1.0625, 1.1875], device=DEVICE)
    y = torch.empty(x.shape, dtype=FP8, device=DEVICE)
    kernel[(1,)](x, y, x.numel(), BLOCK=32)
    want = x.clamp(-448, 448).cpu().to(FP8)
    assert torch.equal(y.float().cpu(), want.float())
    assert y.float()[:4].tolist() == [448.0, -448.0, 448.0, 448.0]
    assert not torch.isnan(y.float()).any()


def gemv_reference(x, w, scale=None, bias=None):
    y = x.double() @ w.double().T
    if scale is not None:
        y = y * scale.double()[None, :]
    if bias is not None:
        y = y + bias.double()[None, :]
    return y


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("m, n, k, split", [(1, 64, 256, 1), (3, 37, 200, 1), (8, 96, 1000, 4), (17, 130, 520, 2)])
def test_gemv_matches_the_reference(wdtype, m, n, k, split):
    torch.manual_seed(m * 7 + n)
    adtype = torch.float32 if wdtype == torch.float32 else torch.bfloat16
    x = torch.randn(m, k, device=DEVICE).to(adtype)
    scale = bias = None
    if wdtype == FP8:
        w, scale = fp8.quantize_rows_reference(torch.randn(n, k))
        w, scale = w.to(DEVICE), scale.to(DEVICE)
        bias = torch.randn(n, device=DEVICE).to(adtype)
    else:
        w = torch.randn(n, k, device=DEVICE).to(wdtype)
    cfg = GemvConfig(block_n=32, block_k=64, split=split)
    got = gemv(x, w, scale, bias, cfg)
    assert got.dtype == adtype and got.shape == (m, n)
    want = gemv_reference(x.cpu(), w.cpu().float(), None if scale is None else scale.cpu(),
                          None if bias is None else bias.cpu())
    # Products in float32 (the interpreter; tensor cores sum bf16 products in float32 too),
    # one rounding to the activations' dtype at the end.
    tol = 1e-4 if adtype == torch.float32 else 2 ** -7
    assert ((got.double().cpu() - want).abs() <= tol * (1 + want.abs())).all()
    # Splits change only the order of float32 partial sums: the default config agrees.
    other = gemv(x, w, scale, bias, default_config(n, k, w.dtype))
    assert ((other.double().cpu() - want).abs() <= tol * (1 + want.abs())).all()


def test_gemv_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="gemv takes"):
        gemv(torch.randn(2, 16, device=DEVICE), torch.randn(8, 12, device=DEVICE))


@pytest.mark.parametrize("rows", [1, 5, 12])
def test_fp8_linear_on_both_paths(rows):
    """Up to its GEMV rows the FP8 layer reads the weights with bf16 activations; above,
    the activations are quantized per token for torch._scaled_mm: both against the
    product of the dequantized weights, within FP8's activation error."""
    torch.manual_seed(rows)
    n, k = 48, 64
    w = torch.randn(n, k)
    q, s = fp8.quantize_rows_reference(w)
    layer = fp8.Fp8Linear(q.to(DEVICE), s.to(DEVICE), gemv_max_rows=8)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    got = layer(x.to(DEVICE), bias.to(DEVICE)).cpu()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    wq = q.float() * s[:, None]
    exact = gemv_reference(x, wq, None, bias)
    if rows <= 8:   # bf16 activations: only the output's rounding
        assert ((got.double() - exact).abs() <= 2 ** -7 * (1 + exact.abs())).all()
    else:           # e4m3 activations: each product off by up to 1/16 of the activation
        xq, xs = fp8.quantize_rows_reference(x)
        want = gemv_reference(xq.float() * xs[:, None], wq, None, bias)
        assert ((got.double() - want).abs() <= 2 ** -6 * (1 + want.abs())).all()
        assert (got.double() - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_fp8_scales_must_be_positive_and_finite():
    fp8.check_scales(torch.tensor([1.0, 2e-9]), "ok")
    for bad in ([1.0, -1.0], [0.0], [float("nan")], [float("inf")]):
        with pytest.raises(ValueError, match="finite and > 0"):
            fp8.check_scales(torch.tensor(bad), "layer.weight_scale")


def test_fp8_cache_round_trip_keeps_values_to_e4m3_precision():
    torch.manual_seed(2)
    dense = torch.randn(2, 3, 16, 32) * 5
    dense[0, 1, 4] = 0.0
    cache = kv_fp8.fp8_cache_from_dense(dense)
    assert cache.dtype == FP8 and cache.shape == (2, 3, 16, 36)
    back = kv_fp8.dense_from_fp8_cache(cache)
    assert back[0, 1, 4].abs().max() == 0
    # Half an e4m3 step: 1/16 of the value, or of the subnormals' step past the scale.
    assert ((back - dense).abs() <= dense.abs() / 16 + dense.abs().amax(-1, keepdim=True) / (448 * 512)).all()


def test_rope_write_into_an_fp8_cache_writes_the_torch_paths_bytes():
    from sluice.backends.torch_ref import TORCH_OPS
    torch.manual_seed(0)
    t, hq, hkv, d, bs = 7, 6, 2, 32, 16
    qkv = (torch.randn(t, (hq + 2 * hkv) * d) * 3).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 40, 41, 17, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, -1)
    cos, sin = emb.cos()[:, None, :].to(DEVICE), emb.sin()[:, None, :].to(DEVICE)
    slots = torch.tensor([3, 4, 5, 40, 41, 17, 60], device=DEVICE)
    caches = [(torch.zeros(hkv, 5, bs, d + 4, dtype=FP8, device=DEVICE),
               torch.zeros(hkv, 5, bs, d + 4, dtype=FP8, device=DEVICE)) for _ in range(2)]
    want_q = TORCH_OPS.rope_write_kv(qkv, cos, sin, caches[0], slots, hq, hkv, d)
    got_q = ta.rope_write_kv(qkv, cos, sin, caches[1][0], caches[1][1], slots, hq, hkv, d)
    assert (got_q - want_q).abs().max() < 1e-5
    for got, want in zip(caches[1], caches[0]):
        g, w = kv_fp8.dense_from_fp8_cache(got.cpu()), kv_fp8.dense_from_fp8_cache(want.cpu())
        if GPU:
            assert ((g - w).abs() <= w.abs().amax(-1, keepdim=True) / 16 + 1e-6).all()
        else:
            assert torch.equal(g, w)
    assert kv_fp8.dense_from_fp8_cache(caches[1][1].cpu()).abs().sum() > 0


def to_fp8_caches(kc, vc):
    return kv_fp8.fp8_cache_from_dense(kc.cpu()).to(DEVICE), kv_fp8.fp8_cache_from_dense(vc.cpu()).to(DEVICE)


@pytest.mark.parametrize("hq, hkv, d, bs, chunks", [
    (6, 2, 32, 16, [(0, 37), (10, 1), (0, 1), (31, 17)]),
    (9, 3, 64, 16, [(15, 1), (16, 1), (17, 1), (47, 3)]),
    (8, 2, 16, 8, [(0, 64), (100, 20)]),
])
def test_attention_over_an_fp8_cache_matches_the_reference_on_its_values(hq, hkv, d, bs, chunks):
    """The kernels read e4m3 keys and values with their per-token scales: the same
    attention as the reference over the values the cache holds."""
    rng = random.Random(hq * 10 + d)
    q, kc, vc, bt, sl, qs = make_batch(rng, chunks, hq, hkv, d, bs)
    k8, v8 = to_fp8_caches(kc, vc)
    kd, vd = kv_fp8.dense_from_fp8_cache(k8.cpu()), kv_fp8.dense_from_fp8_cache(v8.cpu())
    scale = d ** -0.5
    want = ref_attention(q.cpu(), kd, vd, bt.cpu(), sl.cpu(), qs.cpu(), scale)
    block_q = ta.block_q_for(hq // hkv, max(q for _, q in chunks))
    reqs, q0s = ta.varlen_tiles(qs.tolist(), block_q)
    got = ta.varlen_attention(q, k8, v8, bt, sl, qs, torch.tensor(reqs, dtype=torch.int32, device=DEVICE),
                              torch.tensor(q0s, dtype=torch.int32, device=DEVICE), block_q, scale)
    assert (got.double().cpu() - want).abs().max() < 1e-4
    # ... and within FP8's error of the unquantized attention.
    exact = ref_attention(q.cpu(), kc.cpu(), vc.cpu(), bt.cpu(), sl.cpu(), qs.cpu(), scale)
    assert (got.double().cpu() - exact).abs().mean() < 0.05


@pytest.mark.parametrize("splits, window", [(1, 0), (4, 0), (3, 20)])
def test_split_k_decode_over_an_fp8_cache(splits, window):
    rng = random.Random(splits + window)
    chunks = [(200, 1), (5, 1), (129, 1), (64, 1)]
    q, kc, vc, bt, sl, qs = make_batch(rng, chunks, 8, 2, 32, 16)
    k8, v8 = to_fp8_caches(kc, vc)
    want = ref_attention(q.cpu(), kv_fp8.dense_from_fp8_cache(k8.cpu()), kv_fp8.dense_from_fp8_cache(v8.cpu()),
                         bt.cpu(), sl.cpu(), qs.cpu(), 32 ** -0.5, window)
    split_len = -(-max(c + 1 for c, _ in chunks) // splits)
    got = ta.decode_attention(q, k8, v8, bt, sl, splits, split_len, 32 ** -0.5, window=window)
    assert (got.double().cpu() - want).abs().max() < 1e-4


def test_calibration_keeps_the_gemv_only_where_it_was_faster():
    """The backend runs the GEMV at a row count only where it timed faster than the other
    path on the layer's shape (here a given timer: the GEMV with 64 columns a program wins
    at 1 and 2 rows); the layer methods then take the chosen path and compute the same."""
    from sluice.backends.cuda.fp8 import GemvLinear
    from sluice.backends.cuda.gemv import calibrate, candidates, row_bucket

    def timer(fn, rows, cfg):
        fn()  # each candidate really runs
        if cfg is None:
            return 10.0
        return 5.0 + cfg.split if rows <= 2 and cfg.block_n == 64 else 20.0

    torch.manual_seed(5)
    w = torch.randn(48, 512, device=DEVICE)
    choice = calibrate(w, None, lambda x: torch.nn.functional.linear(x, w), torch.float32, timer=timer)
    assert sorted(choice.configs) == [1, 2] and all(c.block_n == 64 for c in choice.configs.values())
    # The fastest of the winners: the fewest splits the candidates offered at 64 columns.
    assert choice.configs[1].split == min(c.split for c in candidates(48, 512, torch.float32, 132) if c.block_n == 64)
    assert choice.times[8] == (20.0, 10.0)
    assert choice.pick(1) is choice.configs[1] and choice.pick(2) is choice.configs[2]
    assert choice.pick(3) is None and choice.pick(9) is None and row_bucket(3) == 4
    layer = GemvLinear(w, choice)
    for rows in (1, 2, 5):
        x = torch.randn(rows, 512, device=DEVICE)
        want = x.double().cpu() @ w.double().cpu().T
        assert (layer(x).double().cpu() - want).abs().max() < 1e-3
    q, s = fp8.quantize_rows_reference(w.cpu())
    fp8_layer = fp8.Fp8Linear(q.to(DEVICE), s.to(DEVICE), choice)
    assert fp8_layer.gemv_config(1) is choice.configs[1] and fp8_layer.gemv_config(4) is None
