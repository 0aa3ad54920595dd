// The greedy fast path's approximate LM head on CPUs without vpdpbusd (GreedyHead in
// backends/prepare.py): int8 weights times activations quantized to 7 bits per block of 32.
//
// Why: the head is ~9% of a c32 run on the plain AVX2 build, in w8a8's sign trick
// (vpsignb, vpmaddubsw, vpmaddwd, vpaddd per 32 products: w8a8.cpp). With |x| <= 63 the
// weights can be the unsigned operand, q + 128 (1..255): a pair of products is at most
// 2 x 255 x 63 = 32,130, so vpmaddubsw cannot saturate and the sign trick's vpsignb goes.
// The 7-bit activations only pick the 16 candidates that the bf16 head then rescores
// exactly: over ~8,000 greedy steps of the default model the true best ranked at most 2nd
// among them, as with 8-bit ones (docs/lab-notes.md, session 37).
//
// Per block of 32 k: isum = sum((q + 128) * x7) - 128 * sum(x7) (exact), then
// acc += float(isum) * sx; at the end acc * the column's scale. Builds with vpdpbusd run
// the same integer sums, so every build gives the same bits.
#include "aten.h"

#include <cstdint>
#include <cstring>

#include "kernels.h"

#include "simd.h"

namespace sluice {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 32;
constexpr int kStepsPerBlock = kBlock / 4;
constexpr int kRows = 4;

int64_t padded_k(int64_t K) { return (K + kBlock - 1) / kBlock * kBlock; }

struct Acts7 {
  const int8_t* q;      // [M, Kp] in -63..63
  const float* scales;  // [M, nblk]
  const int32_t* off;   // [M, nblk]: -128 * the block's sum of q (where its int32 sums start)
  int64_t Kp;
};

// Row r of x (K bf16) to 7 bits per block of 32: scale max|x| / 63, round to nearest even.
void quantize_row7(const uint16_t* xr, int64_t K, int8_t* q, float* scales, int32_t* off) {
  const int64_t nblk = padded_k(K) / kBlock;
  for (int64_t b = 0; b < nblk; ++b) {
    __m512 v[kBlock / kLanes];
    const float mx = load_block32(xr, K, b, v);
    const float id = mx > 0.0f ? 63.0f / mx : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < kBlock / kLanes; ++i) {
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(id)));
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + i * kLanes), _mm512_cvtsepi32_epi8(qi));
    }
    scales[b] = mx / 63.0f;
    off[b] = -128 * _mm512_reduce_add_epi32(sum);
  }
}

#if defined(SLUICE_SIGN_TRICK)
// The plain AVX2 build's 4-row block as asm with every register fixed (GCC's build of the
// template below ran at ~0.85x its speed): int32 sums in ymm0-7 (row r: 2r columns 0-7,
// 2r+1 columns 8-15), each block's starting at its offset; the step's weights in ymm8-9,
// vpmaddwd's ones in ymm10, a row's 4 activation bytes broadcast into ymm11, products in
// ymm12-13, a row's block scale in ymm15; the float sums in acc (64 floats, zeroed by the
// caller), in block<4>'s order: acc = fma(float(sum), sx, acc).
#define SLUICE_H7_INIT(oaddr, lo, hi) \
  "vpbroadcastd " oaddr ", %%ymm" lo "\n\t" "vmovdqa %%ymm" lo ", %%ymm" hi "\n\t"
#define SLUICE_H7_ROW(xaddr, lo, hi)                              \
  "vpbroadcastd " xaddr ", %%ymm11\n\t"                           \
  "vpmaddubsw %%ymm11, %%ymm8, %%ymm12\n\t"                       \
  "vpmaddubsw %%ymm11, %%ymm9, %%ymm13\n\t"                       \
  "vpmaddwd %%ymm10, %%ymm12, %%ymm12\n\t"                        \
  "vpmaddwd %%ymm10, %%ymm13, %%ymm13\n\t"                        \
  "vpaddd %%ymm12, %%ymm" lo ", %%ymm" lo "\n\t"                  \
  "vpaddd %%ymm13, %%ymm" hi ", %%ymm" hi "\n\t"
#define SLUICE_H7_STEP(s)                                         \
  "vmovdqu " #s "*64(%[w]), %%ymm8\n\t"                           \
  "vmovdqu " #s "*64+32(%[w]), %%ymm9\n\t"                        \
  SLUICE_H7_ROW(#s "*4(%[q])", "0", "1")                          \
  SLUICE_H7_ROW(#s "*4(%[q],%[kp],1)", "2", "3")                  \
  SLUICE_H7_ROW(#s "*4(%[q],%[kp],2)", "4", "5")                  \
  SLUICE_H7_ROW(#s "*4(%[q3])", "6", "7")
#define SLUICE_H7_SCALE(saddr, lo, hi, off)                       \
  "vcvtdq2ps %%ymm" lo ", %%ymm" lo "\n\t"                        \
  "vcvtdq2ps %%ymm" hi ", %%ymm" hi "\n\t"                        \
  "vbroadcastss " saddr ", %%ymm15\n\t"                           \
  "vfmadd213ps " off "(%[acc]), %%ymm15, %%ymm" lo "\n\t"         \
  "vfmadd213ps " off "+32(%[acc]), %%ymm15, %%ymm" hi "\n\t"      \
  "vmovups %%ymm" lo ", " off "(%[acc])\n\t"                      \
  "vmovups %%ymm" hi ", " off "+32(%[acc])\n\t"

// w: the group's first step; q: row 0's activations, kp bytes per row; s, o: row 0's
// block scales and offsets, nblk per row; pf: the Prefetch's share per block.
void block_4_avx2(float* acc, const uint8_t* w, const int8_t* q, int64_t kp, const float* s, const int32_t* o,
                  int64_t nblk, Prefetch pf) {
  const int8_t* q3 = q + 3 * kp;
  const float* s3 = s + 3 * nblk;
  const int32_t* o3 = o + 3 * nblk;
  const int64_t ns = nblk * 4, lps = pf.lines_per_step;
  const char* p = pf.p;
  const char* pend = pf.p ? pf.end : nullptr;
  int64_t n = nblk, tmp;
  asm volatile(
      "vpcmpeqw %%ymm10, %%ymm10, %%ymm10\n\t" "vpsrlw $15, %%ymm10, %%ymm10\n\t"  // 1 in every int16
      "1:\n\t"
      SLUICE_ASM_PREFETCH_SHARE
      SLUICE_H7_INIT("(%[o])", "0", "1") SLUICE_H7_INIT("(%[o],%[ns],1)", "2", "3")
      SLUICE_H7_INIT("(%[o],%[ns],2)", "4", "5") SLUICE_H7_INIT("(%[o3])", "6", "7")
      SLUICE_H7_STEP(0) SLUICE_H7_STEP(1) SLUICE_H7_STEP(2) SLUICE_H7_STEP(3)
      SLUICE_H7_STEP(4) SLUICE_H7_STEP(5) SLUICE_H7_STEP(6) SLUICE_H7_STEP(7)
      SLUICE_H7_SCALE("(%[s])", "0", "1", "0")
      SLUICE_H7_SCALE("(%[s],%[ns],1)", "2", "3", "64")
      SLUICE_H7_SCALE("(%[s],%[ns],2)", "4", "5", "128")
      SLUICE_H7_SCALE("(%[s3])", "6", "7", "192")
      "add $512, %[w]\n\t" "add $32, %[q]\n\t" "add $32, %[q3]\n\t" "add $4, %[s]\n\t" "add $4, %[s3]\n\t"
      "add $4, %[o]\n\t" "add $4, %[o3]\n\t"
      "decq %[n]\n\t" "jnz 1b\n\t"
      : [w] "+r"(w), [q] "+r"(q), [q3] "+r"(q3), [s] "+r"(s), [s3] "+r"(s3), [o] "+r"(o), [o3] "+r"(o3),
        [p] "+r"(p), [n] "+m"(n), [tmp] "=&r"(tmp)
      : [kp] "r"(kp), [ns] "r"(ns), [acc] "r"(acc), [pend] "m"(pend), [lps] "m"(lps)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm15", "memory", "cc");
}
#undef SLUICE_H7_INIT
#undef SLUICE_H7_ROW
#undef SLUICE_H7_STEP
#undef SLUICE_H7_SCALE
constexpr bool kAsmBlock = true;
#else
constexpr bool kAsmBlock = false;
inline void block_4_avx2(float*, const uint8_t*, const int8_t*, int64_t, const float*, const int32_t*, int64_t,
                         Prefetch) {}
#endif

// R rows x one group of 16 columns over the whole of K, times the columns' scales.
template <int R>
void block(const uint8_t* w, int64_t KS, const Acts7& x, int64_t nb, int64_t m0, float* out, int64_t N,
           const float* colscale, Prefetch pf) {
  const int64_t nblk = x.Kp / kBlock;
  __m512 acc[R];
  if (kAsmBlock && R == 4 && nblk > 0) {
    alignas(64) float sums[R * kLanes] = {};
    block_4_avx2(sums, w + nb * KS * kLanes * 4, x.q + m0 * x.Kp, x.Kp, x.scales + m0 * nblk, x.off + m0 * nblk,
                 nblk, pf);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_load_ps(sums + r * kLanes);
  } else {
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b) {
      pf.step();
      __m512i isum[R];
      for (int r = 0; r < R; ++r) isum[r] = _mm512_set1_epi32(x.off[(m0 + r) * nblk + b]);
      for (int s = 0; s < kStepsPerBlock; ++s) {
        const int64_t step = b * kStepsPerBlock + s;
        const __m512i wv = _mm512_loadu_si512(w + (nb * KS + step) * kLanes * 4);
        for (int r = 0; r < R; ++r) isum[r] = dot4_unsigned_signed(isum[r], wv, x.q + (m0 + r) * x.Kp + step * 4);
      }
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_set1_ps(x.scales[(m0 + r) * nblk + b]), acc[r]);
    }
  }
  const int64_t n0 = nb * kLanes, left = N - n0;
  const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  const __m512 cs = _mm512_maskz_loadu_ps(m, colscale + n0);
  for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(out + (m0 + r) * N + n0, m, _mm512_mul_ps(acc[r], cs));
}

}  // namespace

// [N, K] int8 weights in -127..127 -> w8a8_pack_weight's layout with each weight as q + 128
// (the unsigned operand), on every build.
at::Tensor head_w8a7_pack(at::Tensor q) {
  auto packed = w8a8_pack_weight(q);
#if defined(SLUICE_SIGN_TRICK)
  packed.bitwise_xor_(0x80);  // this build's w8a8 packing is signed: flipping the top bit adds 128
#endif
  return packed;
}

// x: [M, K] bf16; packed: head_w8a7_pack's; scale: [N] float32 per output column.
// Returns [M, N] float32.
at::Tensor head_w8a7(at::Tensor x, at::Tensor packed, at::Tensor scale, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(2) == kLanes &&
                  packed.size(3) == 4, "weights packed as w8a8_pack_weight packs them expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), Kp = padded_k(K), KS = Kp / 4, nblk = Kp / kBlock;
  const int64_t NB = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(packed.size(0) == NB && packed.size(1) == KS, "packed weight does not match [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == N,
              "one float32 scale per output column expected");
  auto out = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return out;
  auto q = at::empty({M, Kp}, x.options().dtype(at::kChar));  // every block written, zeros past K
  auto scales = at::empty({M, nblk}, x.options().dtype(at::kFloat));
  auto off = at::empty({M, nblk}, x.options().dtype(at::kInt));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  sluice::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row7(xp + r * K, K, q.data_ptr<int8_t>() + r * Kp, scales.data_ptr<float>() + r * nblk,
                    off.data_ptr<int32_t>() + r * nblk);
  });
  const Acts7 acts{q.data_ptr<int8_t>(), scales.data_ptr<float>(), off.data_ptr<int32_t>(), Kp};
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const float* cs = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_panels(M, NB, 1, kRows, w, KS * kLanes * 4, nblk, [&](int64_t nb0, int /*C*/, int64_t m0, int r, Prefetch pf) {
    switch (r) {
      case 1: return block<1>(w, KS, acts, nb0, m0, op, N, cs, pf);
      case 2: return block<2>(w, KS, acts, nb0, m0, op, N, cs, pf);
      default: return block<kRows>(w, KS, acts, nb0, m0, op, N, cs, pf);
    }
  });
  return out;
}

}  // namespace sluice
