// int8 x int8 linear layers (`--quantization w8a8`): int8 weights, activations quantized
// to int8 on the fly, products summed in int32 by AVX-512 VNNI.
//
// Why: at 32 rows and in prompt chunks a linear layer is bound by arithmetic, not by
// reading weights, and one vpdpbusd does 64 byte products where vdpbf16ps does 32 bf16
// ones at the same rate (measured on this CPU: 466 G int8 ops/s per core against 233
// GFLOP/s). So the same matmul takes about half the instructions.
//
// Format, as llama.cpp's Q8_0 activations: each row of x is cut into blocks of kBlock k,
// each block scaled by its own max |x| / 127 and rounded to int8. One scale per row
// instead (per-token quantization) measured 10x the KL divergence from float32 on
// SmolLM2: a few channels carry values far above the rest and crush everyone else's
// resolution in their row. Weights are int8 with one scale per output column, the same
// weights as `--quantization int8`.
//
// vpdpbusd multiplies unsigned by signed bytes, so weights are stored as q + 128 (1..255)
// and the activations are the signed side: each block's sum is then sum(q_w * q_x) +
// 128 * sum(q_x), and the second term does not depend on the column, so it is taken off
// once per row at the end (`corr`), not per block and column.
// The AVX2 build, which has no vpdpbusd, stores the weights signed and gets the same
// int32 sums another way (dpbusd below).
//
// Every output element is reduced in an order fixed by its row alone (blocks in order,
// k in order within a block, a row quantized by itself), so these kernels are
// batch-invariant like batch_invariant.cpp's.
#include "aten.h"

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"

#include "simd.h"

// SLUICE_SIGN_TRICK (simd.h), the plain AVX2 build: signed weights, |x| and each block's
// offset kept with the quantized rows. The AVX-512 and avx2_vnni builds have vpdpbusd:
// weights + 128, the offset taken off once per row.

namespace sluice {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 32;              // k per activation scale
constexpr int kStepsPerBlock = kBlock / 4;  // vpdpbusd takes 4 k per lane
constexpr int kRows = 4;                // register block: kRows x kCols int32 + as many float32
constexpr int kCols = 3;
// AVX2 has 16 vector registers for AVX-512's 32 and each 16-lane sum takes two: there a
// block of kRows rows runs its column groups one at a time (block_cols).
#if defined(SLUICE_AVX2)
constexpr int kMaxSums = 8;             // 16-lane int32 sums a block keeps in registers
#else
constexpr int kMaxSums = kRows * kCols;
#endif

// A W8A8Rows' pointers, as the register blocks read them.
struct Acts {
  const int8_t* q;        // [M, Kp] int8
  const int8_t* qabs;     // AVX2: |q|; AVX-512: q (unused)
  const int32_t* boff;    // AVX2: [M, nblk] 128 * each block's sum of q; AVX-512: null
  const float* scales;    // [M, nblk]
  const float* corr;      // [M]
  int64_t Kp;
};

// dpbusd (simd.h): acc += w . x over 4 k per lane, by the sign trick on plain AVX2.

int64_t padded_k(int64_t K) { return (K + kBlock - 1) / kBlock * kBlock; }

}  // namespace

// One row of x (K bf16) -> its int8 values, per-block scales and offset correction, in
// rows' row r: what the +128 weight offset adds is corr = 128 * sum over blocks of
// scale * sum(q). Every row is quantized alone, so a row's values never depend on its batch.
void w8a8_quantize_row(const uint16_t* xr, W8A8Rows& rows, int64_t r) {
  const int64_t K = rows.K, Kp = padded_k(K), nblk = Kp / kBlock;
  int8_t* q = rows.q.data_ptr<int8_t>() + r * Kp;
  float* scales = rows.scales.data_ptr<float>() + r * nblk;
  float* bsums = rows.bsums.data_ptr<float>() + r * nblk;
#if defined(SLUICE_SIGN_TRICK)
  int8_t* qabs = rows.qabs.data_ptr<int8_t>() + r * Kp;
  int32_t* boff = rows.boff.data_ptr<int32_t>() + r * nblk;
#endif
  float c = 0.0f;
  for (int64_t b = 0; b < nblk; ++b) {
    __m512 v[kBlock / kLanes];
    const float mx = load_block32(xr, K, b, v);
    const float d = mx / 127.0f, id = mx > 0.0f ? 127.0f / mx : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < kBlock / kLanes; ++i) {
      // Round to nearest even (the default rounding mode); |x * id| <= 127 by construction.
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(id)));
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + i * kLanes), _mm512_cvtsepi32_epi8(qi));
#if defined(SLUICE_SIGN_TRICK)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qabs + b * kBlock + i * kLanes),
                       _mm512_cvtsepi32_epi8(_mm512_abs_epi32(qi)));
#endif
    }
    scales[b] = d;
    const int32_t bsum = _mm512_reduce_add_epi32(sum);
#if defined(SLUICE_SIGN_TRICK)
    boff[b] = 128 * bsum;
#endif
    bsums[b] = d * static_cast<float>(bsum);
    c += bsums[b];
  }
  rows.corr.data_ptr<float>()[r] = 128.0f * c;
}

W8A8Rows w8a8_rows(int64_t M, int64_t K, const at::TensorOptions& options) {
  const int64_t Kp = padded_k(K);
  W8A8Rows rows{at::empty({M, Kp}, options.dtype(at::kChar)),
                at::empty({M, Kp / kBlock}, options.dtype(at::kFloat)),
                at::empty({M}, options.dtype(at::kFloat)), K};
  rows.bsums = at::empty({M, Kp / kBlock}, options.dtype(at::kFloat));
#if defined(SLUICE_SIGN_TRICK)
  rows.qabs = at::empty({M, Kp}, options.dtype(at::kChar));
  rows.boff = at::empty({M, Kp / kBlock}, options.dtype(at::kInt));
#endif
  return rows;
}

namespace {

#if !defined(SLUICE_AVX2)
// The 4-row x 3-group block, the one nearly all of a linear layer's work runs in at 32
// rows and more, as one asm loop over K with every register fixed: int32 sums in
// zmm0-11, float32 sums in zmm12-23, weights in zmm24-26, activations broadcast into
// zmm27-28, block scales in zmm29-30. The same instructions on the same values in the
// same order as block<4, 3> below (so the same bits: the row-invariance test compares the
// two), but GCC's build of that template stored its float sums to memory every block and
// let the embedded broadcast load each row's bytes once per column group. Measured: the
// 120 linear layers at 256 rows 93.7 -> 84.1 ms, at 32 rows 14.1 -> 13.4 ms, the w8a8 LM
// head at 32 rows 3.8 -> 3.5 ms; in the engine, alternating every step, c32 decode steps
// 28.5 -> 27.4 ms and steps with prompt chunks 140 -> 129 ms (medians).
#define SLUICE_W8A8_ROW(qaddr, bc, a0, a1, a2)                   \
  "vpbroadcastd " qaddr ", %%zmm" bc "\n\t"                      \
  "vpdpbusd %%zmm" bc ", %%zmm24, %%zmm" a0 "\n\t"               \
  "vpdpbusd %%zmm" bc ", %%zmm25, %%zmm" a1 "\n\t"               \
  "vpdpbusd %%zmm" bc ", %%zmm26, %%zmm" a2 "\n\t"
#define SLUICE_W8A8_STEP(s)                                      \
  "vmovdqu64 " #s "*64(%[w]), %%zmm24\n\t"                       \
  "vmovdqu64 " #s "*64(%[w],%[wst],1), %%zmm25\n\t"              \
  "vmovdqu64 " #s "*64(%[w],%[wst],2), %%zmm26\n\t"              \
  SLUICE_W8A8_ROW(#s "*4(%[q])", "27", "0", "1", "2")            \
  SLUICE_W8A8_ROW(#s "*4(%[q],%[kp],1)", "28", "3", "4", "5")    \
  SLUICE_W8A8_ROW(#s "*4(%[q],%[kp],2)", "27", "6", "7", "8")    \
  SLUICE_W8A8_ROW(#s "*4(%[q3])", "28", "9", "10", "11")
#define SLUICE_W8A8_SCALE(saddr, bc, i0, i1, i2, f0, f1, f2)     \
  "vbroadcastss " saddr ", %%zmm" bc "\n\t"                      \
  "vfmadd231ps %%zmm" bc ", %%zmm" i0 ", %%zmm" f0 "\n\t"        \
  "vfmadd231ps %%zmm" bc ", %%zmm" i1 ", %%zmm" f1 "\n\t"        \
  "vfmadd231ps %%zmm" bc ", %%zmm" i2 ", %%zmm" f2 "\n\t"

// acc[12][16] <- the block's float sums before the offset and column scales. w: the first
// of 3 panels, wst bytes apart; q: row 0's activations, kp bytes per row; s: row 0's
// block scales, ns floats per row; pf: the Prefetch's share, lps lines per block.
void block_4x3_asm(float* acc, const uint8_t* w, int64_t wst, const int8_t* q, int64_t kp, const float* s,
                   int64_t ns, int64_t nblk, Prefetch pf) {
  const int8_t* q3 = q + 3 * kp;
  const float* s3 = s + 3 * ns;
  const int64_t ns_bytes = ns * 4, lps = pf.lines_per_step;
  const char* p = pf.p;
  const char* pend = pf.p ? pf.end : nullptr;
  int64_t tmp;
  asm volatile(
      "vpxord %%zmm12, %%zmm12, %%zmm12\n\t" "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
      "vpxord %%zmm14, %%zmm14, %%zmm14\n\t" "vpxord %%zmm15, %%zmm15, %%zmm15\n\t"
      "vpxord %%zmm16, %%zmm16, %%zmm16\n\t" "vpxord %%zmm17, %%zmm17, %%zmm17\n\t"
      "vpxord %%zmm18, %%zmm18, %%zmm18\n\t" "vpxord %%zmm19, %%zmm19, %%zmm19\n\t"
      "vpxord %%zmm20, %%zmm20, %%zmm20\n\t" "vpxord %%zmm21, %%zmm21, %%zmm21\n\t"
      "vpxord %%zmm22, %%zmm22, %%zmm22\n\t" "vpxord %%zmm23, %%zmm23, %%zmm23\n\t"
      "1:\n\t"
      SLUICE_ASM_PREFETCH_SHARE
      "vpxord %%zmm0, %%zmm0, %%zmm0\n\t" "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"
      "vpxord %%zmm2, %%zmm2, %%zmm2\n\t" "vpxord %%zmm3, %%zmm3, %%zmm3\n\t"
      "vpxord %%zmm4, %%zmm4, %%zmm4\n\t" "vpxord %%zmm5, %%zmm5, %%zmm5\n\t"
      "vpxord %%zmm6, %%zmm6, %%zmm6\n\t" "vpxord %%zmm7, %%zmm7, %%zmm7\n\t"
      "vpxord %%zmm8, %%zmm8, %%zmm8\n\t" "vpxord %%zmm9, %%zmm9, %%zmm9\n\t"
      "vpxord %%zmm10, %%zmm10, %%zmm10\n\t" "vpxord %%zmm11, %%zmm11, %%zmm11\n\t"
      SLUICE_W8A8_STEP(0) SLUICE_W8A8_STEP(1) SLUICE_W8A8_STEP(2) SLUICE_W8A8_STEP(3)
      SLUICE_W8A8_STEP(4) SLUICE_W8A8_STEP(5) SLUICE_W8A8_STEP(6) SLUICE_W8A8_STEP(7)
      "vcvtdq2ps %%zmm0, %%zmm0\n\t" "vcvtdq2ps %%zmm1, %%zmm1\n\t" "vcvtdq2ps %%zmm2, %%zmm2\n\t"
      "vcvtdq2ps %%zmm3, %%zmm3\n\t" "vcvtdq2ps %%zmm4, %%zmm4\n\t" "vcvtdq2ps %%zmm5, %%zmm5\n\t"
      "vcvtdq2ps %%zmm6, %%zmm6\n\t" "vcvtdq2ps %%zmm7, %%zmm7\n\t" "vcvtdq2ps %%zmm8, %%zmm8\n\t"
      "vcvtdq2ps %%zmm9, %%zmm9\n\t" "vcvtdq2ps %%zmm10, %%zmm10\n\t" "vcvtdq2ps %%zmm11, %%zmm11\n\t"
      SLUICE_W8A8_SCALE("(%[s])", "29", "0", "1", "2", "12", "13", "14")
      SLUICE_W8A8_SCALE("(%[s],%[ns],1)", "30", "3", "4", "5", "15", "16", "17")
      SLUICE_W8A8_SCALE("(%[s],%[ns],2)", "29", "6", "7", "8", "18", "19", "20")
      SLUICE_W8A8_SCALE("(%[s3])", "30", "9", "10", "11", "21", "22", "23")
      "add $512, %[w]\n\t" "add $32, %[q]\n\t" "add $32, %[q3]\n\t" "add $4, %[s]\n\t" "add $4, %[s3]\n\t"
      "dec %[n]\n\t" "jnz 1b\n\t"
      "vmovups %%zmm12, 0*64(%[acc])\n\t" "vmovups %%zmm13, 1*64(%[acc])\n\t" "vmovups %%zmm14, 2*64(%[acc])\n\t"
      "vmovups %%zmm15, 3*64(%[acc])\n\t" "vmovups %%zmm16, 4*64(%[acc])\n\t" "vmovups %%zmm17, 5*64(%[acc])\n\t"
      "vmovups %%zmm18, 6*64(%[acc])\n\t" "vmovups %%zmm19, 7*64(%[acc])\n\t" "vmovups %%zmm20, 8*64(%[acc])\n\t"
      "vmovups %%zmm21, 9*64(%[acc])\n\t" "vmovups %%zmm22, 10*64(%[acc])\n\t" "vmovups %%zmm23, 11*64(%[acc])\n\t"
      : [w] "+r"(w), [q] "+r"(q), [q3] "+r"(q3), [s] "+r"(s), [s3] "+r"(s3), [n] "+r"(nblk), [p] "+r"(p),
        [tmp] "=&r"(tmp)
      : [wst] "r"(wst), [kp] "r"(kp), [ns] "r"(ns_bytes), [pend] "r"(pend), [lps] "r"(lps), [acc] "r"(acc)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "xmm15", "xmm16", "xmm17", "xmm18", "xmm19", "xmm20", "xmm21", "xmm22", "xmm23", "xmm24",
        "xmm25", "xmm26", "xmm27", "xmm28", "xmm29", "xmm30", "memory", "cc");
}
#undef SLUICE_W8A8_ROW
#undef SLUICE_W8A8_STEP
#undef SLUICE_W8A8_SCALE
constexpr bool kAsmBlock = true;
#else
// (AVX-512 registers only.)
constexpr bool kAsmBlock = false;
inline void block_4x3_asm(float*, const uint8_t*, int64_t, const int8_t*, int64_t, const float*, int64_t, int64_t,
                          Prefetch) {}
#endif

#if defined(SLUICE_SIGN_TRICK)
// The AVX2 build's 4-row x 16-column block, one block of kBlock k, as asm with every
// register fixed: int32 sums in ymm0-7 (row r's columns 0-7 and 8-15 in ymm 2r and
// 2r+1), the step's weights in ymm8-9, vpmaddwd's ones in ymm10, a row's 4 activation
// bytes and their |x| broadcast into ymm11-12, products in ymm13-14. dpbusd's
// instructions on the same values in the same order. GCC's build of the same loop kept
// three of the eight sums in memory (a store-to-load round trip on each every step); the
// 120 layers measured 189 -> 156 ms at 256 rows, 26.8 -> 20.9 ms at 32 rows.
#define SLUICE_AVX2_ROW(xaddr, aaddr, lo, hi)               \
  "vpbroadcastd " xaddr ", %%ymm11\n\t"                    \
  "vpbroadcastd " aaddr ", %%ymm12\n\t"                    \
  "vpsignb %%ymm11, %%ymm8, %%ymm13\n\t"                   \
  "vpsignb %%ymm11, %%ymm9, %%ymm14\n\t"                   \
  "vpmaddubsw %%ymm13, %%ymm12, %%ymm13\n\t"               \
  "vpmaddubsw %%ymm14, %%ymm12, %%ymm14\n\t"               \
  "vpmaddwd %%ymm10, %%ymm13, %%ymm13\n\t"                 \
  "vpmaddwd %%ymm10, %%ymm14, %%ymm14\n\t"                 \
  "vpaddd %%ymm13, %%ymm" lo ", %%ymm" lo "\n\t"           \
  "vpaddd %%ymm14, %%ymm" hi ", %%ymm" hi "\n\t"
#define SLUICE_AVX2_STEP(s)                                                        \
  "vmovdqu " #s "*64(%[w]), %%ymm8\n\t"                                          \
  "vmovdqu " #s "*64+32(%[w]), %%ymm9\n\t"                                       \
  SLUICE_AVX2_ROW(#s "*4(%[q])", #s "*4(%[a])", "0", "1")                         \
  SLUICE_AVX2_ROW(#s "*4(%[q],%[kp],1)", #s "*4(%[a],%[kp],1)", "2", "3")         \
  SLUICE_AVX2_ROW(#s "*4(%[q],%[kp],2)", #s "*4(%[a],%[kp],2)", "4", "5")         \
  SLUICE_AVX2_ROW(#s "*4(%[q3])", #s "*4(%[a3])", "6", "7")

// sums[4][16] <- row r's block offset boff[r * nblk] plus its block of products. w: the
// group's first step in the block; q, a: row 0's activations and |activations| at the
// block's first k, kp bytes per row.
void block_4x1_avx2(int32_t* sums, const uint8_t* w, const int8_t* q, const int8_t* a, int64_t kp,
                    const int32_t* boff, int64_t nblk) {
  const int8_t* q3 = q + 3 * kp;
  const int8_t* a3 = a + 3 * kp;
  const int32_t* b3 = boff + 3 * nblk;
  const int64_t nb = nblk * 4;
  asm volatile(
      "vpbroadcastd (%[bo]), %%ymm0\n\t" "vmovdqa %%ymm0, %%ymm1\n\t"
      "vpbroadcastd (%[bo],%[nb],1), %%ymm2\n\t" "vmovdqa %%ymm2, %%ymm3\n\t"
      "vpbroadcastd (%[bo],%[nb],2), %%ymm4\n\t" "vmovdqa %%ymm4, %%ymm5\n\t"
      "vpbroadcastd (%[b3]), %%ymm6\n\t" "vmovdqa %%ymm6, %%ymm7\n\t"
      "vpcmpeqw %%ymm10, %%ymm10, %%ymm10\n\t" "vpsrlw $15, %%ymm10, %%ymm10\n\t"  // 1 in every int16
      SLUICE_AVX2_STEP(0) SLUICE_AVX2_STEP(1) SLUICE_AVX2_STEP(2) SLUICE_AVX2_STEP(3)
      SLUICE_AVX2_STEP(4) SLUICE_AVX2_STEP(5) SLUICE_AVX2_STEP(6) SLUICE_AVX2_STEP(7)
      "vmovdqu %%ymm0, 0*32(%[out])\n\t" "vmovdqu %%ymm1, 1*32(%[out])\n\t"
      "vmovdqu %%ymm2, 2*32(%[out])\n\t" "vmovdqu %%ymm3, 3*32(%[out])\n\t"
      "vmovdqu %%ymm4, 4*32(%[out])\n\t" "vmovdqu %%ymm5, 5*32(%[out])\n\t"
      "vmovdqu %%ymm6, 6*32(%[out])\n\t" "vmovdqu %%ymm7, 7*32(%[out])\n\t"
      :
      : [w] "r"(w), [q] "r"(q), [q3] "r"(q3), [a] "r"(a), [a3] "r"(a3), [kp] "r"(kp), [bo] "r"(boff),
        [b3] "r"(b3), [nb] "r"(nb), [out] "r"(sums)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm14", "memory");
}
#undef SLUICE_AVX2_ROW
#undef SLUICE_AVX2_STEP
constexpr bool kAvx2Block = true;
#else
// (AVX2 build only.)
constexpr bool kAvx2Block = false;
inline void block_4x1_avx2(int32_t*, const uint8_t*, const int8_t*, const int8_t*, int64_t, const int32_t*,
                           int64_t) {}
#endif

#if defined(SLUICE_AVX_VNNI)
// The avx2_vnni build's 4-row x 16-column block over the whole of K, as asm with every
// register fixed: int32 sums in ymm0-7 (row r's columns 0-7 and 8-15 in ymm 2r and
// 2r+1), the step's weights in ymm8-9, a row's 4 activation bytes broadcast into ymm10,
// a block scale in ymm15. Per block of kBlock k, vpdpbusd on the same values in the same
// order as block<4, 1> below, then its float multiply-add, acc += float(sum) * scale,
// with the float sums in memory (beside the int32 sums they do not fit in 16 registers):
// the same bits. Measured alone on one core against the sign trick's block (the plain
// AVX2 build): ~160 against ~72 G byte products/s.
#define SLUICE_VNNI_ROW(xaddr, lo, hi)                                           \
  "vpbroadcastd " xaddr ", %%ymm10\n\t"                                          \
  "%{vex%} vpdpbusd %%ymm10, %%ymm8, %%ymm" lo "\n\t"                              \
  "%{vex%} vpdpbusd %%ymm10, %%ymm9, %%ymm" hi "\n\t"
#define SLUICE_VNNI_STEP(s)                                                      \
  "vmovdqu " #s "*64(%[w]), %%ymm8\n\t"                                          \
  "vmovdqu " #s "*64+32(%[w]), %%ymm9\n\t"                                       \
  SLUICE_VNNI_ROW(#s "*4(%[q])", "0", "1")                                       \
  SLUICE_VNNI_ROW(#s "*4(%[q],%[kp],1)", "2", "3")                               \
  SLUICE_VNNI_ROW(#s "*4(%[q],%[kp],2)", "4", "5")                               \
  SLUICE_VNNI_ROW(#s "*4(%[q3])", "6", "7")
#define SLUICE_VNNI_SCALE(saddr, lo, hi, off)                                    \
  "vbroadcastss " saddr ", %%ymm15\n\t"                                          \
  "vcvtdq2ps %%ymm" lo ", %%ymm" lo "\n\t"                                       \
  "vcvtdq2ps %%ymm" hi ", %%ymm" hi "\n\t"                                       \
  "vfmadd213ps " off "(%[acc]), %%ymm15, %%ymm" lo "\n\t"                        \
  "vfmadd213ps " off "+32(%[acc]), %%ymm15, %%ymm" hi "\n\t"                     \
  "vmovups %%ymm" lo ", " off "(%[acc])\n\t"                                      \
  "vmovups %%ymm" hi ", " off "+32(%[acc])\n\t"

// acc[4][16] (zeroed by the caller) <- the float sums of block<4, 1> before the offset and
// column scales. w: the group's first step; q: row 0's activations, kp bytes per row; s:
// row 0's block scales, nblk per row; pf: the Prefetch's share, lines_per_step per block.
void block_4x1_vnni(float* acc, const uint8_t* w, const int8_t* q, int64_t kp, const float* s, int64_t nblk,
                    Prefetch pf) {
  const int8_t* q3 = q + 3 * kp;
  const float* s3 = s + 3 * nblk;
  const int64_t ns = nblk * 4, lps = pf.lines_per_step;
  const char* p = pf.p;
  const char* pend = pf.p ? pf.end : nullptr;
  int64_t n = nblk, tmp;
  asm volatile(
      "1:\n\t"
      SLUICE_ASM_PREFETCH_SHARE
      "vpxor %%ymm0, %%ymm0, %%ymm0\n\t" "vpxor %%ymm1, %%ymm1, %%ymm1\n\t"
      "vpxor %%ymm2, %%ymm2, %%ymm2\n\t" "vpxor %%ymm3, %%ymm3, %%ymm3\n\t"
      "vpxor %%ymm4, %%ymm4, %%ymm4\n\t" "vpxor %%ymm5, %%ymm5, %%ymm5\n\t"
      "vpxor %%ymm6, %%ymm6, %%ymm6\n\t" "vpxor %%ymm7, %%ymm7, %%ymm7\n\t"
      SLUICE_VNNI_STEP(0) SLUICE_VNNI_STEP(1) SLUICE_VNNI_STEP(2) SLUICE_VNNI_STEP(3)
      SLUICE_VNNI_STEP(4) SLUICE_VNNI_STEP(5) SLUICE_VNNI_STEP(6) SLUICE_VNNI_STEP(7)
      SLUICE_VNNI_SCALE("(%[s])", "0", "1", "0") SLUICE_VNNI_SCALE("(%[s],%[ns],1)", "2", "3", "64")
      SLUICE_VNNI_SCALE("(%[s],%[ns],2)", "4", "5", "128") SLUICE_VNNI_SCALE("(%[s3])", "6", "7", "192")
      "add $512, %[w]\n\t" "add $32, %[q]\n\t" "add $32, %[q3]\n\t" "add $4, %[s]\n\t" "add $4, %[s3]\n\t"
      "decq %[n]\n\t" "jnz 1b\n\t"
      : [w] "+r"(w), [q] "+r"(q), [q3] "+r"(q3), [s] "+r"(s), [s3] "+r"(s3), [p] "+r"(p), [n] "+m"(n),
        [tmp] "=&r"(tmp)
      : [kp] "r"(kp), [ns] "r"(ns), [acc] "r"(acc), [pend] "m"(pend), [lps] "m"(lps)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm15", "memory",
        "cc");
}
#undef SLUICE_VNNI_ROW
#undef SLUICE_VNNI_STEP
#undef SLUICE_VNNI_SCALE
constexpr bool kVnniBlock = true;
#else
// (avx2_vnni build only.)
constexpr bool kVnniBlock = false;
inline void block_4x1_vnni(float*, const uint8_t*, const int8_t*, int64_t, const float*, int64_t, Prefetch) {}
#endif

// R rows x C groups of 16 columns. Per block: int32 sums of kBlock k, then one
// float multiply-add by the row's block scale; at the end the offset term and the
// column scales.
template <int R, int C>
void block(const uint8_t* w, int64_t KS, const Acts& x, int64_t nb0, const float* wscale, const float* bias, int64_t N,
           bool out_f32, void* out, int64_t m0, Prefetch pf) {
  const int8_t* q = x.q;
  const float *scales = x.scales, *corr = x.corr;
  const int64_t Kp = x.Kp, nblk = Kp / kBlock;
  __m512 acc[R][C];
  if (kAsmBlock && R == 4 && C == 3 && nblk > 0) {  // (K > 0: the asm loop runs at least once)
    alignas(64) float sums[R * C * kLanes];
    block_4x3_asm(sums, w + nb0 * KS * kLanes * 4, KS * kLanes * 4, q + m0 * Kp, Kp, scales + m0 * nblk, nblk, nblk,
                  pf);
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_load_ps(sums + (r * C + c) * kLanes);
  } else if (kVnniBlock && R == 4 && C == 1 && nblk > 0) {
    alignas(64) float sums[R * kLanes] = {};
    block_4x1_vnni(sums, w + nb0 * KS * kLanes * 4, q + m0 * Kp, Kp, scales + m0 * nblk, nblk, pf);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_load_ps(sums + r * kLanes);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b) {
      __m512i isum[R][C];
      if constexpr (kAvx2Block && R == 4 && C == 1) {
        pf.step();
        alignas(32) int32_t sums[R * kLanes];
        block_4x1_avx2(sums, w + (nb0 * KS + b * kStepsPerBlock) * kLanes * 4, q + m0 * Kp + b * kBlock,
                       x.qabs + m0 * Kp + b * kBlock, Kp, x.boff + m0 * nblk + b, nblk);
        for (int r = 0; r < R; ++r) isum[r][0] = _mm512_load_si512(sums + r * kLanes);
      } else {
        for (int r = 0; r < R; ++r) {
#if defined(SLUICE_SIGN_TRICK)
          const __m512i start = _mm512_set1_epi32(x.boff[(m0 + r) * nblk + b]);
#else
          const __m512i start = _mm512_setzero_si512();
#endif
          for (int c = 0; c < C; ++c) isum[r][c] = start;
        }
        pf.step();
        for (int s = 0; s < kStepsPerBlock; ++s) {
          const int64_t step = b * kStepsPerBlock + s;
          __m512i wv[C];
          for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + ((nb0 + c) * KS + step) * kLanes * 4);
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c)
              dpbusd(isum[r][c], wv[c], q + (m0 + r) * Kp + step * 4, x.qabs + (m0 + r) * Kp + step * 4);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 d = _mm512_set1_ps(scales[(m0 + r) * nblk + b]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), d, acc[r][c]);
      }
    }
  }
  const size_t esz = out_f32 ? 4 : 2;
  for (int r = 0; r < R; ++r) {
    char* row = static_cast<char*>(out) + (m0 + r) * N * esz;
    const __m512 off = _mm512_set1_ps(corr[m0 + r]);
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = (nb0 + c) * kLanes, left = N - n0;
      const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      __m512 v = _mm512_mul_ps(_mm512_sub_ps(acc[r][c], off), _mm512_maskz_loadu_ps(m, wscale + n0));
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n0));
      if (out_f32) _mm512_mask_storeu_ps(reinterpret_cast<float*>(row) + n0, m, v);
      else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(row) + n0, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

template <int R>
void block_cols(int C, const uint8_t* w, int64_t KS, const Acts& x, int64_t nb0, const float* wscale, const float* bias,
                int64_t N, bool out_f32, void* out, int64_t m0, Prefetch pf) {
  if constexpr (R * kCols > kMaxSums) {  // one group at a time (the same sums, in the same order)
    for (int c = 0; c < C; ++c) block<R, 1>(w, KS, x, nb0 + c, wscale, bias, N, out_f32, out, m0, pf);
    return;
  }
  switch (C) {
    case 1: return block<R, 1>(w, KS, x, nb0, wscale, bias, N, out_f32, out, m0, pf);
    case 2: return block<R, 2>(w, KS, x, nb0, wscale, bias, N, out_f32, out, m0, pf);
    default: return block<R, kCols>(w, KS, x, nb0, wscale, bias, N, out_f32, out, m0, pf);
  }
}

}  // namespace

// q: [N, K] int8 -> [N/16][Kp/4][16][4] uint8 holding q + 128, N padded to 16 and K to
// a whole block (the padding's activations are zero, so its weights do not matter).
at::Tensor w8a8_pack_weight(at::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8 weight must be [N, K] int8");
  TORCH_CHECK(q.numel() == 0 || q.min().item<int8_t>() >= -127, "w8a8 weights must lie in -127..127");
  q = q.contiguous();
  const int64_t N = q.size(0), K = q.size(1), NB = (N + kLanes - 1) / kLanes, KS = padded_k(K) / 4;
#if defined(SLUICE_SIGN_TRICK)
  constexpr int kOffset = 0;  // AVX2 multiplies signed weights (dpbusd above)
#else
  constexpr int kOffset = 128;
#endif
  auto out = at::full({NB, KS, kLanes, 4}, kOffset, q.options().dtype(at::kByte));
  const int8_t* src = q.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      dst[(((n / kLanes) * KS + k / 4) * kLanes + n % kLanes) * 4 + k % 4] =
          static_cast<uint8_t>(src[n * K + k] + kOffset);
  return out;
}

void w8a8_quantize_into(const at::Tensor& x, W8A8Rows& rows) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "x must be [M, K] bfloat16, contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(rows.q.size(0) == M && rows.K == K, "quantized rows made for another shape");
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  sluice::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) w8a8_quantize_row(xp + r * K, rows, r);
  });
}

W8A8Rows w8a8_quantize(at::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  x = x.contiguous();
  W8A8Rows rows = w8a8_rows(x.size(0), x.size(1), x.options());
  w8a8_quantize_into(x, rows);
  return rows;
}

// x: [M, K] bf16; packed from w8a8_pack_weight; scale: [N] per output column. Returns
// [M, N] bf16, or float32 when out_float32 (the LM head).
at::Tensor linear_w8a8(at::Tensor x, at::Tensor packed, at::Tensor scale, int64_t N,
                       c10::optional<at::Tensor> bias, bool out_float32) {
  return linear_w8a8_rows(w8a8_quantize(x), packed, scale, N, bias, out_float32);
}

// The linear layer over activations already quantized (by linear_w8a8, or by a fused
// norm or SwiGLU that quantizes each row as it makes it: one pass and one parallel
// region fewer than producing bf16 rows and quantizing them here).
at::Tensor linear_w8a8_rows(const W8A8Rows& x, at::Tensor packed, at::Tensor scale, int64_t N,
                            c10::optional<at::Tensor> bias, bool out_float32) {
  auto out = at::empty({x.q.size(0), N}, x.q.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  linear_w8a8_rows_into(x, packed, scale, N, bias, out);
  return out;
}

void linear_w8a8_rows_into(const W8A8Rows& x, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                           const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  TORCH_CHECK(packed.scalar_type() == at::kByte, "weights packed by w8a8_pack_weight expected");
  const int64_t M = x.q.size(0), K = x.K, Kp = padded_k(K), KS = Kp / 4;
  TORCH_CHECK(packed.size(0) == (N + kLanes - 1) / kLanes && packed.size(1) == KS, "packed weight does not match [N, K]");
  const bool out_float32 = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
              (out_float32 || out.scalar_type() == at::kBFloat16), "out must be [M, N] bfloat16 or float32");
  auto scale_f = scale.to(at::kFloat).contiguous();
  TORCH_CHECK(scale_f.numel() == N, "one scale per output column");
  const auto bias_f = float_or_empty(bias);
  if (M == 0) return;
  const uint8_t* w = packed.data_ptr<uint8_t>();
#if defined(SLUICE_SIGN_TRICK)
  const Acts acts{x.q.data_ptr<int8_t>(), x.qabs.data_ptr<int8_t>(), x.boff.data_ptr<int32_t>(),
                  x.scales.data_ptr<float>(), x.corr.data_ptr<float>(), Kp};
#else
  const Acts acts{x.q.data_ptr<int8_t>(), x.q.data_ptr<int8_t>(), nullptr, x.scales.data_ptr<float>(),
                  x.corr.data_ptr<float>(), Kp};
#endif
  const float* ws = scale_f.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  void* op = out.data_ptr();
  const int64_t NB = (N + kLanes - 1) / kLanes;
  for_panels(M, NB, kCols, kRows, w, KS * kLanes * 4, Kp / kBlock,
             [&](int64_t nb0, int C, int64_t m0, int r, Prefetch pf) {
               switch (r) {
                 case 1: return block_cols<1>(C, w, KS, acts, nb0, ws, bp, N, out_float32, op, m0, pf);
                 case 2: return block_cols<2>(C, w, KS, acts, nb0, ws, bp, N, out_float32, op, m0, pf);
                 default: return block_cols<kRows>(C, w, KS, acts, nb0, ws, bp, N, out_float32, op, m0, pf);
               }
             });
}

}  // namespace sluice
