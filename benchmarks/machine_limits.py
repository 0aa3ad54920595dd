"""What the cores and memory can do, per ISA build: the ceilings the kernels are judged by.

    python benchmarks/machine_limits.py [--isa avx2|avx2_vnni|avx512]

- fp32 FMA: GFLOP/s of independent vfmadd231ps chains (12 accumulators), one core and all;
- int8 dot products as the build does them: AVX2's vpmaddubsw + vpmaddwd + vpaddd (w8a8's
  inner step), AVX-VNNI's 256-bit vpdpbusd (avx2_vnni) or AVX-512 VNNI's vpdpbusd, in G int8 ops/s (a multiply and an add per
  byte pair), one core and all;
- memory: GB/s of reading a 1 GiB buffer with vector loads, all cores;
- AVX-512 only, what bounds the int8 kernels and a decode's attention:
  - vpdpbusd beside FMAs: 8 vpdpbusd and 3 float multiply-adds a round, w4a8's mix (per
    row, 16 columns and block of 32: 8 dot products, then the block's scale times the
    activation's, and two multiply-adds). Where the FMAs take the vpdpbusd pipes the rate
    falls to 8/11 of the peak: the 4-bit kernels' ceiling;
  - scattered blocks: reading 2 KB blocks (a bf16 KV block of 16 rows of 64) in a random
    order, as a decode walks its block tables, on 4 KB pages and on huge pages
    (backends/cpu/huge_pages.py), all cores.
Each figure is the best of 5 runs (a ceiling, not a typical value).
"""
from __future__ import annotations

import argparse
import time

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <omp.h>
#include <cstdint>

#if defined(__AVX512F__)
using V = __m512; using VI = __m512i;
#define LANES 16
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define SET1(x) _mm512_set1_ps(x)
#define LOADI(p) _mm512_loadu_si512(p)
#else
using V = __m256; using VI = __m256i;
#define LANES 8
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define SET1(x) _mm256_set1_ps(x)
#define LOADI(p) _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))
#endif

// flops done by `threads` threads, each `iters` x 12 FMAs of LANES lanes.
double fma_peak(int64_t iters, int threads) {
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    V a[12];
    for (int i = 0; i < 12; ++i) a[i] = SET1(1.0f + i * 1e-3f);
    const V m = SET1(0.999999f), c = SET1(1e-7f);
    // Unrolled by hand: 12 chains in registers, 4-cycle FMA latency, 2 FMA pipes.
    V a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3], a4 = a[4], a5 = a[5], a6 = a[6], a7 = a[7], a8 = a[8],
      a9 = a[9], a10 = a[10], a11 = a[11];
    for (int64_t it = 0; it < iters; ++it) {
      a0 = FMA(a0, m, c); a1 = FMA(a1, m, c); a2 = FMA(a2, m, c); a3 = FMA(a3, m, c);
      a4 = FMA(a4, m, c); a5 = FMA(a5, m, c); a6 = FMA(a6, m, c); a7 = FMA(a7, m, c);
      a8 = FMA(a8, m, c); a9 = FMA(a9, m, c); a10 = FMA(a10, m, c); a11 = FMA(a11, m, c);
    }
    a[0] = a0; a[1] = a1; a[2] = a2; a[3] = a3; a[4] = a4; a[5] = a5; a[6] = a6; a[7] = a7; a[8] = a8;
    a[9] = a9; a[10] = a10; a[11] = a11;
    float out[LANES];
    for (int i = 1; i < 12; ++i) a[0] = FMA(a[0], m, a[i]);
#if defined(__AVX512F__)
    _mm512_storeu_ps(out, a[0]);
#else
    _mm256_storeu_ps(out, a[0]);
#endif
    sink += out[0];
  }
  if (sink == 12345.f) printf("%f", sink);
  return 2.0 * LANES * 12 * iters * threads;
}

// int8 ops (2 per byte product) by `threads` threads, independent accumulators (8 to 12 by build).
double int8_peak(int64_t iters, int threads) {
  int64_t sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    alignas(64) int8_t buf[64];
    for (int i = 0; i < 64; ++i) buf[i] = static_cast<int8_t>(i * 7 - 100);
    VI w = LOADI(buf), acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = LOADI(buf);
#if defined(__AVX512F__)
    // 12 chains: a full-width core (Zen 5) issues 2 a cycle at a latency of ~5, which 8
    // chains cannot feed (936 against 1,050 G ops/s on one Zen 5 core).
    const VI x = _mm512_set1_epi32(0x01020304);
    VI c[12];
    for (int i = 0; i < 12; ++i) c[i] = acc[i % 8];
    for (int64_t it = 0; it < iters; ++it)
      for (int i = 0; i < 12; ++i) c[i] = _mm512_dpbusd_epi32(c[i], w, x);
    for (int i = 1; i < 12; ++i) c[0] = _mm512_add_epi32(c[0], c[i]);
    sink += _mm512_reduce_add_epi32(c[0]);
#elif defined(__AVXVNNI__)
    // AVX-VNNI's 256-bit vpdpbusd (VEX), the avx2_vnni build's inner step: 12 chains (2 a
    // cycle at a latency of 5 need 10; 8 measured 345 against 518 G ops/s on one core).
    const VI x = _mm256_set1_epi32(0x01020304);
    VI c[12];
    for (int i = 0; i < 12; ++i) c[i] = acc[i % 8];
    for (int64_t it = 0; it < iters; ++it)
      for (int i = 0; i < 12; ++i) c[i] = _mm256_dpbusd_avx_epi32(c[i], w, x);
    for (int i = 0; i < 8; ++i) acc[i] = c[i];
    for (int i = 8; i < 12; ++i) acc[0] = _mm256_add_epi32(acc[0], c[i]);
    for (int i = 1; i < 8; ++i) acc[0] = _mm256_add_epi32(acc[0], acc[i]);
    alignas(32) int32_t out[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), acc[0]);
    sink += out[0];
#else
    // Six chains, each with its own weights, which an empty asm marks as changed every
    // iteration: without it the compiler hoists the loop-invariant products out of the loop.
    const VI x = _mm256_set1_epi32(0x01020304), ones = _mm256_set1_epi16(1);
    VI w0 = w, w1 = w, w2 = w, w3 = w, w4 = w, w5 = w;
    VI a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], a4 = acc[4], a5 = acc[5];
#define SL_STEP(a, wv) \
  asm volatile("" : "+x"(wv)); \
  a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(x, wv), ones));
    for (int64_t it = 0; it < iters; ++it) {
      SL_STEP(a0, w0) SL_STEP(a1, w1) SL_STEP(a2, w2) SL_STEP(a3, w3) SL_STEP(a4, w4) SL_STEP(a5, w5)
    }
#undef SL_STEP
    acc[0] = _mm256_add_epi32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)),
                              _mm256_add_epi32(a4, a5));
    alignas(32) int32_t out[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), acc[0]);
    sink += out[0];
#endif
  }
  if (sink == 12345) printf("%ld", static_cast<long>(sink));
#if defined(__AVX512F__)
  return 2.0 * LANES * 4 * 12 * iters * threads;
#elif defined(__AVXVNNI__)
  return 2.0 * LANES * 4 * 12 * iters * threads;
#else
  return 2.0 * LANES * 4 * 6 * iters * threads;
#endif
}

#if defined(__AVX512F__)
// int8 ops by `threads` threads, each round 8 vpdpbusd (8 chains) and 3 FMAs (3 chains):
// w4a8's mix of dot products and float block arithmetic. Counts the vpdpbusd's ops only.
double int8_fma_mix(int64_t iters, int threads) {
  int64_t sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    VI acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm512_set1_epi32(i);
    V f0 = SET1(1.f), f1 = SET1(2.f), f2 = SET1(3.f);
    const VI w = _mm512_set1_epi32(0x01020304), x = _mm512_set1_epi32(0x01010101);
    const V m = SET1(0.999999f), c = SET1(1e-7f);
    for (int64_t it = 0; it < iters; ++it) {
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
      f0 = FMA(f0, m, c); f1 = FMA(f1, m, c); f2 = FMA(f2, m, c);
    }
    for (int i = 1; i < 8; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
    sink += _mm512_reduce_add_epi32(acc[0]) + static_cast<int64_t>(_mm512_reduce_add_ps(FMA(f0, f1, f2)));
  }
  if (sink == 12345) printf("%ld", static_cast<long>(sink));
  return 2.0 * LANES * 4 * 8 * iters * threads;
}
#else
double int8_fma_mix(int64_t, int) { return 0; }
#endif

// Reads the 2 KB blocks of buf in the order `order` gives (block numbers), each block's
// 32 lines with vector loads, split over the threads; returns bytes read.
double read_blocks(torch::Tensor buf, torch::Tensor order, int threads) {
  const int8_t* p = buf.data_ptr<int8_t>();
  const int64_t* o = order.data_ptr<int64_t>();
  const int64_t n = order.numel(), bytes = 2048;
  int64_t sink = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sink)
  for (int64_t i = 0; i < n; ++i) {
    const int8_t* b = p + o[i] * bytes;
    VI a = LOADI(b);
    for (int64_t j = LANES * 4; j < bytes; j += LANES * 4) {
#if defined(__AVX512F__)
      a = _mm512_add_epi32(a, LOADI(b + j));
#else
      a = _mm256_add_epi32(a, LOADI(b + j));
#endif
    }
#if defined(__AVX512F__)
    sink += _mm512_reduce_add_epi32(a) & 1;
#else
    sink += _mm256_extract_epi32(a, 0) & 1;
#endif
  }
  if (sink == -1) printf("x");
  return static_cast<double>(n * bytes);
}

// Reads buf (bytes) once with all threads; returns bytes read.
double read_bw(torch::Tensor buf, int threads) {
  const int8_t* p = buf.data_ptr<int8_t>();
  const int64_t n = buf.numel(), step = LANES * 4 * 4;
  int64_t sink = 0;
#pragma omp parallel for num_threads(threads) reduction(+ : sink)
  for (int64_t i = 0; i < n; i += step) {
    VI a = LOADI(p + i), b = LOADI(p + i + LANES * 4);
    VI c = LOADI(p + i + 2 * LANES * 4), d = LOADI(p + i + 3 * LANES * 4);
#if defined(__AVX512F__)
    sink += _mm512_reduce_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a, b), _mm512_add_epi32(c, d))) & 1;
#else
    sink += _mm256_extract_epi32(_mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d)), 0) & 1;
#endif
  }
  if (sink == -1) printf("x");
  return static_cast<double>(n);
}
"""

FLAGS = {"avx512": ["-march=x86-64-v4", "-mavx512vnni"], "avx2_vnni": ["-march=x86-64-v3", "-mavxvnni"],
         "avx2": ["-march=x86-64-v3"]}


def best_rate(fn, *args) -> float:
    rates = []
    for _ in range(5):
        t = time.perf_counter()
        work = fn(*args)
        rates.append(work / (time.perf_counter() - t))
    return max(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isa", default="avx2", choices=list(FLAGS))
    args = ap.parse_args()
    mod = load_inline(f"sluice_machine_limits_{args.isa}", cpp_sources=SOURCE,
                      functions=["fma_peak", "int8_peak", "read_bw", "int8_fma_mix", "read_blocks"],
                      extra_cflags=["-O3", "-funroll-loops", "-fopenmp", *FLAGS[args.isa]], extra_ldflags=["-fopenmp"])
    threads = torch.get_num_threads()
    op = {"avx512": "vpdpbusd", "avx2_vnni": "vpdpbusd (VEX, 256 bits)"}.get(args.isa, "vpmaddubsw + vpmaddwd + vpaddd")
    print(f"isa {args.isa}, {threads} threads")
    for t in sorted({1, threads}):
        print(f"fp32 FMA, {t} core(s): {best_rate(mod.fma_peak, 20_000_000 // t, t) / 1e9:.0f} GFLOP/s")
        print(f"int8 {op}, {t} core(s): {best_rate(mod.int8_peak, 20_000_000 // t, t) / 1e9:.0f} G int8 ops/s")
    buf = torch.ones(2**30, dtype=torch.int8)
    print(f"memory read, {threads} cores: {best_rate(mod.read_bw, buf, threads) / 1e9:.1f} GB/s")
    if args.isa == "avx512":
        for t in sorted({1, threads}):
            print(f"int8 vpdpbusd with w4a8's 3 FMAs per 8, {t} core(s): "
                  f"{best_rate(mod.int8_fma_mix, 20_000_000 // t, t) / 1e9:.0f} G int8 ops/s")
    # 256 MB of 2 KB blocks (a c32 decode's K/V at ~300 tokens is ~200 MB), read in a random
    # order, on 4 KB pages (torch's allocation) and on huge pages.
    from sluice.backends.cpu.huge_pages import huge_zeros
    del buf
    order = torch.randperm(2**17)
    small = torch.ones(2**28, dtype=torch.int8)
    print(f"scattered 2 KB blocks, 4 KB pages, {threads} cores: "
          f"{best_rate(mod.read_blocks, small, order, threads) / 1e9:.1f} GB/s")
    del small
    huge = huge_zeros((2**28,), torch.int8).fill_(1)
    print(f"scattered 2 KB blocks, huge pages, {threads} cores: "
          f"{best_rate(mod.read_blocks, huge, order, threads) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
