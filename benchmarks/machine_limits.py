"""What the cores and memory can do, per ISA build: the ceilings the kernels are judged by.

    python benchmarks/machine_limits.py [--isa avx2|avx2_vnni|avx512]

- fp32 FMA: GFLOP/s of independent vfmadd231ps chains (12 accumulators), one core and all;
- int8 dot products as the build does them: AVX2's vpmaddubsw + vpmaddwd + vpaddd (w8a8's
  inner step), AVX-VNNI's 256-bit vpdpbusd (avx2_vnni) or AVX-512 VNNI's vpdpbusd, in G int8 ops/s (a multiply and an add per
  byte pair), one core and all;
- memory: GB/s of reading a 1 GiB buffer with vector loads, all cores.
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

// int8 ops (2 per byte product) by `threads` threads, 8 independent accumulators.
double int8_peak(int64_t iters, int threads) {
  int64_t sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    alignas(64) int8_t buf[64];
    for (int i = 0; i < 64; ++i) buf[i] = static_cast<int8_t>(i * 7 - 100);
    VI w = LOADI(buf), acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = LOADI(buf);
#if defined(__AVX512F__)
    const VI x = _mm512_set1_epi32(0x01020304);
    for (int64_t it = 0; it < iters; ++it)
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, x);
    for (int i = 1; i < 8; ++i) acc[0] = _mm512_add_epi32(acc[0], acc[i]);
    sink += _mm512_reduce_add_epi32(acc[0]);
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
  return 2.0 * LANES * 4 * 8 * iters * threads;
#elif defined(__AVXVNNI__)
  return 2.0 * LANES * 4 * 12 * iters * threads;
#else
  return 2.0 * LANES * 4 * 6 * iters * threads;
#endif
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
                      functions=["fma_peak", "int8_peak", "read_bw"],
                      extra_cflags=["-O3", "-funroll-loops", "-fopenmp", *FLAGS[args.isa]], extra_ldflags=["-fopenmp"])
    threads = torch.get_num_threads()
    op = {"avx512": "vpdpbusd", "avx2_vnni": "vpdpbusd (VEX, 256 bits)"}.get(args.isa, "vpmaddubsw + vpmaddwd + vpaddd")
    print(f"isa {args.isa}, {threads} threads")
    for t in sorted({1, threads}):
        print(f"fp32 FMA, {t} core(s): {best_rate(mod.fma_peak, 20_000_000 // t, t) / 1e9:.0f} GFLOP/s")
        print(f"int8 {op}, {t} core(s): {best_rate(mod.int8_peak, 20_000_000 // t, t) / 1e9:.0f} G int8 ops/s")
    buf = torch.ones(2**30, dtype=torch.int8)
    print(f"memory read, {threads} cores: {best_rate(mod.read_bw, buf, threads) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
