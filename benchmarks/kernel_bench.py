"""Timings of the C++ kernels alone, at the default model's shapes (SmolLM2-135M: hidden
576, 9 heads / 3 kv heads of 64, MLP 1,536, vocabulary 49,152), on random weights.

    python benchmarks/kernel_bench.py [--attention-only] [--isa avx512|avx512_vnni|avx2_vnni|avx2]

Linear: the 120 linear layers of a forward pass with 30 distinct sets of weights (so that
they stream from memory as the model's do), bf16 and int8, w8a8 (int8 activations too), w4a8 (4-bit weights,
int8 activations), and the LM head, by rows.
Attention: `paged_attention_varlen` per layer, decode (B sequences of L cached tokens)
and one prompt of L tokens; and a c32 decode step's 30 layers with the K/V streaming from
memory (on huge pages, as the engine's cache is, and a bf16 cache on 4 KB pages too); each
with a bf16 cache and an int8 one (`--kv-cache-dtype int8`). Medians of repeated calls, in ms.
"""
from __future__ import annotations

import statistics
import time

import torch

from sluice.backends.cpu import x86 as kernels
from sluice.backends.cpu.huge_pages import huge_zeros
from sluice.backends.kv_int8 import INT8_ROW_EXTRA, int8_cache_from_dense

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attention-only", action="store_true", help="skip the linear layers")
    ap.add_argument("--isa", default=None, choices=list(kernels.VARIANTS),
                    help="kernel build to time (default: the best this CPU runs)")
    args = ap.parse_args()
    k = kernels.load(args.isa)
    if k is None or not hasattr(k, "bi_linear"):
        raise SystemExit("the C++ kernels are not available on this machine")
    torch.manual_seed(0)
    flops = 2 * 30 * sum(n * kk for n, kk in SHAPES.values())
    bf16 = [{name: k.bi_pack_weight(torch.randn(n, kk, dtype=torch.bfloat16) * 0.02)
             for name, (n, kk) in SHAPES.items()} for _ in range(30)]
    int8 = [{name: (k.bi_pack_weight_int8(torch.randint(-127, 128, (n, kk), dtype=torch.int8)), torch.rand(n) * 0.01)
             for name, (n, kk) in SHAPES.items()} for _ in range(30)]
    w8a8 = [{name: (k.w8a8_pack_weight(torch.randint(-127, 128, (n, kk), dtype=torch.int8)), torch.rand(n) * 0.01)
             for name, (n, kk) in SHAPES.items()} for _ in range(30)] if getattr(k, "has_w8a8", False) else None
    w4a8 = [{name: k.w4a8_pack_weight(torch.randint(0, 16, (n, kk), dtype=torch.uint8),
                                      torch.rand(n, -(-kk // 32)) * 0.01, torch.rand(n, -(-kk // 32)) * -0.05)
             for name, (n, kk) in SHAPES.items()} for _ in range(30)] if hasattr(k, "w4a8_linear") else None
    head = k.bi_pack_weight(torch.randn(49152, 576, dtype=torch.bfloat16) * 0.02)
    head8 = k.w8a8_pack_weight(torch.randint(-127, 128, (49152, 576), dtype=torch.int8)) if w8a8 else None
    hscale = torch.rand(49152) * 0.01
    for m in (() if args.attention_only else (1, 8, 32, 64, 256)):
        if m == 1:
            print("rows | 120 layers bf16 ms (GFLOP/s) | int8 ms | w8a8 ms (GOP/s) | w4a8 ms (GOP/s) "
                  "| LM head bf16 ms | w8a8 ms")
        xs = {name: torch.randn(m, kk, dtype=torch.bfloat16) for name, (n, kk) in SHAPES.items()}
        reps = 15 if m < 256 else 5

        def layers_bf16():
            for layer in bf16:
                for name, (n, _) in SHAPES.items():
                    k.bi_linear(xs[name], layer[name], n, None, False)

        def layers_int8():
            for layer in int8:
                for name, (n, _) in SHAPES.items():
                    k.bi_linear_int8(xs[name], *layer[name], n, None, False)
        def layers_w8a8():
            for layer in w8a8:
                for name, (n, _) in SHAPES.items():
                    k.w8a8_linear(xs[name], *layer[name], n, None, False)

        def layers_w4a8():
            for layer in w4a8:
                for name, (n, _) in SHAPES.items():
                    k.w4a8_linear(xs[name], *layer[name], n, None, False)
        t = median_ms(layers_bf16, reps)
        t8 = median_ms(layers_int8, reps) if m <= 32 else float("nan")
        tq = median_ms(layers_w8a8, reps) if w8a8 else float("nan")
        t4 = median_ms(layers_w4a8, reps) if w4a8 else float("nan")
        th = median_ms(lambda: k.bi_linear(xs["o"], head, 49152, None, True), reps)
        thq = median_ms(lambda: k.w8a8_linear(xs["o"], head8, hscale, 49152, None, True), reps) if w8a8 else float("nan")
        print(f"{m:4d} | {t:7.2f} ({flops * m / t / 1e6:5.1f}) | {t8:7.2f} | {tq:7.2f} ({flops * m / tq / 1e6:5.1f}) "
              f"| {t4:7.2f} ({flops * m / t4 / 1e6:5.1f}) | {th:6.2f} | {thq:6.2f}", flush=True)

    heads, kv_heads, dim, block = 9, 3, 64, 16
    num_blocks = 4096
    kc = torch.randn(kv_heads, num_blocks, block, dim, dtype=torch.bfloat16)
    vc = torch.randn_like(kc)

    caches = {"bf16": (kc, vc), "int8": (int8_cache_from_dense(kc, True), int8_cache_from_dense(vc, False))}

    def attention(q_lens: list[int], ctx: list[int], cache: str) -> float:
        nb = [(c + block - 1) // block for c in ctx]
        table = torch.zeros(len(ctx), max(nb), dtype=torch.long)
        start = 0
        for i, n in enumerate(nb):
            table[i, :n] = torch.arange(start, start + n) % num_blocks
            start += n
        qs = torch.tensor([0] + q_lens).cumsum(0)
        q = torch.randn(int(qs[-1]), heads, dim, dtype=torch.bfloat16)
        lens = torch.tensor(ctx)
        kcc, vcc = caches[cache]
        return median_ms(lambda: k.paged_attention_varlen(q, kcc, vcc, table, qs, lens, dim ** -0.5), 20)
    print("attention, ms per layer, bf16 cache / int8 cache")
    for b, ctx in ((1, 300), (32, 300), (32, 1000)):
        print(f"decode {b} x {ctx}: {attention([1] * b, [ctx] * b, 'bf16'):.3f} / "
              f"{attention([1] * b, [ctx] * b, 'int8'):.3f}", flush=True)
    for ctx in (210, 512, 2048):
        print(f"prompt of {ctx}: {attention([ctx], [ctx], 'bf16'):.3f} / {attention([ctx], [ctx], 'int8'):.3f}",
              flush=True)

    # A decode step's attention as the model runs it: 30 layers, each with its own cache,
    # the blocks of each sequence scattered, so K/V stream from memory (the per-layer
    # figures above reuse one layer's cache, which stays in L3).
    b, ctx = 32, 280
    nb = (ctx + block - 1) // block
    layers = torch.randn(30, 2, kv_heads, b * nb + 64, block, dim).to(torch.bfloat16)
    table = torch.randperm(b * nb + 64)[:b * nb].view(b, nb)
    qs, lens = torch.arange(b + 1), torch.full((b,), ctx)
    q = torch.randn(b, heads, dim, dtype=torch.bfloat16)
    # On huge pages as the engine's cache is (backends/cpu/huge_pages.py), and on torch's
    # 4 KB pages for comparison.
    huge = huge_zeros(tuple(layers.shape), torch.bfloat16).copy_(layers)

    def on_huge(t: torch.Tensor) -> torch.Tensor:
        return huge_zeros(tuple(t.shape), t.dtype).copy_(t)
    variants = {"bf16": (dim * 2, [(layer[0], layer[1]) for layer in huge]),
                "bf16 on 4 KB pages": (dim * 2, [(layer[0], layer[1]) for layer in layers]),
                "int8": (dim + INT8_ROW_EXTRA, [(on_huge(int8_cache_from_dense(layer[0], True)),
                                                 on_huge(int8_cache_from_dense(layer[1], False))) for layer in layers])}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):  # alternating, so that both see the same spells of this shared machine
        for name, (_, per_layer) in variants.items():
            times[name].append(median_ms(lambda: [k.paged_attention_varlen(q, kl, vl, table, qs, lens, dim ** -0.5)
                                                  for kl, vl in per_layer], 5))
    for name, (row_bytes, _) in variants.items():
        t = statistics.median(times[name])
        gb = 30 * b * ctx * kv_heads * row_bytes * 2 / 1e9
        print(f"decode {b} x {ctx}, 30 layers from memory, {name} cache: {t:.2f} ms ({gb / t * 1e3:.1f} GB/s of K/V; "
              f"median of 5 alternating rounds: {' / '.join(f'{x:.2f}' for x in times[name])})", flush=True)


if __name__ == "__main__":
    main()
