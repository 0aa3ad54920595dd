// 4-bit weights x int8 activations (`--quantization w4a8`): weights as llama.cpp's Q4_1
// keeps them, activations quantized to int8 per block of 32 as w8a8's are (w8a8.cpp).
//
// Format: each row of W is cut into blocks of 32 k, each block w ~ d * q + m with q in
// 0..15 (its minimum m, its step d = (max - min) / 15: Q4_1's own form, so a Q4_1 GGUF's
// weights come back as they were stored, to bf16 rounding). Per block of 32 k, an output
// element adds
//     sx * d * sum(q * qx) + m * (sx * sum(qx))
// (sx, qx: the activation block's scale and int8 values; the bracket is the rows'
// `bsums`, made once per row block by w8a8_quantize_row).
//
// Why: on a plain AVX2 CPU w8a8 pays for vpmaddubsw's operand types. Its weights are
// signed, so each product needs the sign trick (vpsignb, then vpmaddubsw, then vpmaddwd
// to widen), three instructions on Intel's two vector-multiply ports per 32 products
// (docs/lab-notes.md). Weights in 0..15 are already the unsigned operand, and a pair of
// products is at most 2 * 15 * 127, so eight vpmaddubsw results add up in int16 without
// overflow: one vpmaddubsw per 32 products, plus an int16 add that port 5 takes too, and
// one vpmaddwd per eight. Builds with vpdpbusd (AVX-512 VNNI, AVX-VNNI) multiply q as the
// unsigned operand with no offset to take off.
//
// Wide weights: the same form with q up to 254, for a GGUF's own blocks of other types
// (`--quantization gguf`, quantization/gguf.py: Q5_0's q + 16, Q8_0's q + 127, Q4_K's
// sub-blocks, ...). w4a8_pack_weight packs them a byte a weight and returns them as int8
// (the tag linear_w4a8_rows goes by); they take the byte path at every row count, never
// the nibbles nor the plain AVX2 build's asm block, whose int16 sums hold 4-bit products
// only. vpdpbusd sums unsigned by signed bytes in int32, so the VNNI builds multiply q as
// it is. Plain AVX2's vpmaddubsw would saturate its int16 pairs (2 * 254 * 127): that build
// stores q - 127 (in -127..127) and multiplies by the sign trick, as w8a8 does, then adds
// 127 * sum(qx) back per block in int32. So every build has the same int32 block sums and
// does the same float arithmetic on them: the same bits. Where every row's blocks are
// symmetric (m = -offset * d: Q5_0, Q8_0, 8-bit blocks), the minimums are not stored: m
// comes as one -offset per row ([N/16][16]) and each block's is d times it, the same
// float32 product the loader computed (exact: offsets of at most 7 bits by a float16 d).
//
// Five-bit weights (q up to 31: a GGUF's Q5_0, Q5_1 and Q5_K blocks) keep 5 bits a weight
// instead of a byte (w4a8_pack_5bit): per block of 32 k and group of 16 columns, the four
// nibble vectors of the nibble layout (two steps each) and then one vector of fifth bits
// (step s of the block in bit s of each byte), 320 bytes in all, tagged by the packed
// tensor's five dimensions. A step's q is its nibbles with its bit moved to bit 4 (a
// 16-bit shift: bits that cross into the next byte land away from bit 4), then the 4-bit
// path's unsigned products, pairs at most 2 * 31 * 127 on plain AVX2's vpmaddubsw.
//
// Every output element is reduced in an order fixed by its row alone (blocks in order, k
// in order within a block, float sums in the same order in every build), so the kernel is
// batch-invariant and every build gives the same bits.
#include "aten.h"

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels.h"

#include "simd.h"

namespace sluice {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 32;                  // k per weight and activation scale
constexpr int kStepsPerBlock = kBlock / 4;  // 4 k per 32-bit lane
constexpr int kRows = 4;                    // register block: kRows x kCols groups of 16 columns
// Steps of at most this many rows read the nibble-packed copy (half the bytes, and an and
// and a shift per vector to unpack), bigger ones the byte layout; measured per build on the
// default model's layers (docs/benchmarks.md, "w4a8 nibbles"). AVX-512: nibbles at every
// row count (c1 -23%, c32 -8%), so no byte layout is kept. AVX2 + AVX-VNNI on ymm halves:
// nibbles to 8 rows (c8 -10%; c32 +6% with them). Plain AVX2: to 4 rows (c1 -35%), since
// from 8 rows its asm block on bytes (below) beats the unpacking intrinsics by 20-45%.
#if defined(SLUICE_SIGN_TRICK)
constexpr int64_t kNibbleMaxRows = 4;
#elif defined(SLUICE_AVX2)
constexpr int64_t kNibbleMaxRows = 8;
#else
constexpr int64_t kNibbleMaxRows = INT64_MAX;
#endif
#if defined(SLUICE_AVX2)
constexpr int kCols = 1;  // 16 ymm registers: one group of 16 columns at a time
#else
constexpr int kCols = 3;
#endif

int64_t padded_k(int64_t K) { return (K + kBlock - 1) / kBlock * kBlock; }

// acc += w . x over 4 k per lane: w unsigned bytes in 0..15, x 4 signed bytes broadcast
// (vpmaddubsw takes w as its unsigned operand as is: pairs are at most 2 * 15 * 128).
inline __m512i dot4(__m512i acc, __m512i w, const int8_t* x4) { return dot4_unsigned_signed(acc, w, x4); }

// A nibble-packed vector (w4a8_pack_nibbles) holds two 4-k steps of a 16-column group:
// the low nibbles the first, the high the second; each comes out as the byte layout's.
inline void unpack_nibbles(__m512i v, __m512i& first, __m512i& second) {
#if defined(SLUICE_AVX2)
  const __m256i low = _mm256_set1_epi8(0x0F);
  first.lo = _mm256_and_si256(v.lo, low);
  first.hi = _mm256_and_si256(v.hi, low);
  second.lo = _mm256_and_si256(_mm256_srli_epi16(v.lo, 4), low);
  second.hi = _mm256_and_si256(_mm256_srli_epi16(v.hi, 4), low);
#else
  const __m512i low = _mm512_set1_epi8(0x0F);
  first = _mm512_and_si512(v, low);
  second = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#endif
}

// Step t (0..7) of a five-bit block: its nibbles (the low four bits of `nib`, already
// shifted down for odd steps) with bit t of each byte of `bits` as bit 4.
inline __m512i merge_fifth(__m512i nib, __m512i bits, int t) {
  const __m512i b = t < 4 ? slli16(bits, 4 - t) : t == 4 ? bits : srli16(bits, t - 4);
  return merge_bits(nib, b, 0x0F0F0F0F, 0x10101010);  // simd.h
}
constexpr int64_t kFiveBlockBytes = 5 * kLanes * 4;  // a five-bit block of one column group
#if defined(SLUICE_AVX2)
constexpr int kFiveRows = kRows;
#else
constexpr int kFiveRows = 8;
#endif

// The activations as W8A8Rows holds them.
struct Acts {
  const int8_t* q;       // [M, Kp]
  const float* scales;   // [M, nblk]: sx
  const float* bsums;    // [M, nblk]: sx * sum(qx)
  int64_t Kp;
  const int8_t* qabs = nullptr;   // plain AVX2: |qx|, for wide weights' sign trick
  const int32_t* boff = nullptr;  // plain AVX2: 128 * each block's sum(qx)
};

#if defined(SLUICE_SIGN_TRICK)
constexpr int kWideOffset = 127;  // wide weights stored as q - 127 (see the top of the file)
#else
constexpr int kWideOffset = 0;
#endif

#if defined(SLUICE_SIGN_TRICK)
// The plain AVX2 build's 4-row x 16-column block over the whole of K, as asm with every
// register fixed: each row's int16 sums of a block in ymm 2r (columns 0-7) and 2r+1
// (8-15), the step's weights in ymm8-9, vpmaddwd's ones in ymm10, a row's 4 activation
// bytes broadcast into ymm11, products and then the block's scales in ymm12-13, a row's
// sx or bsum in ymm15. Per block: eight steps of vpmaddubsw into the int16 sums (at most
// 8 x 2 x 15 x 127 = 30,480: no overflow), vpmaddwd by ones to int32, then block<4, 1>'s
// float arithmetic in its order: acc = fma(float(sum), sx * d, acc); acc = fma(m, bsum, acc).
// The float sums live in acc (64 floats, zeroed by the caller); 16 registers hold no more.
#define SLUICE_W4_ROW(xaddr, lo, hi, OP)                          \
  "vpbroadcastd " xaddr ", %%ymm11\n\t"                           \
  "vpmaddubsw %%ymm11, %%ymm8, %%ymm12\n\t"                       \
  "vpmaddubsw %%ymm11, %%ymm9, %%ymm13\n\t"                       \
  OP(lo, hi)
#define SLUICE_W4_FIRST(lo, hi) "vmovdqa %%ymm12, %%ymm" lo "\n\t" "vmovdqa %%ymm13, %%ymm" hi "\n\t"
#define SLUICE_W4_ADD(lo, hi) "vpaddw %%ymm12, %%ymm" lo ", %%ymm" lo "\n\t" "vpaddw %%ymm13, %%ymm" hi ", %%ymm" hi "\n\t"
#define SLUICE_W4_STEP(s, OP)                                     \
  "vmovdqu " #s "*64(%[w]), %%ymm8\n\t"                           \
  "vmovdqu " #s "*64+32(%[w]), %%ymm9\n\t"                        \
  SLUICE_W4_ROW(#s "*4(%[q])", "0", "1", OP)                      \
  SLUICE_W4_ROW(#s "*4(%[q],%[kp],1)", "2", "3", OP)              \
  SLUICE_W4_ROW(#s "*4(%[q],%[kp],2)", "4", "5", OP)              \
  SLUICE_W4_ROW(#s "*4(%[q3])", "6", "7", OP)
#define SLUICE_W4_SCALE(saddr, baddr, lo, hi, off)                \
  "vpmaddwd %%ymm10, %%ymm" lo ", %%ymm" lo "\n\t"                \
  "vpmaddwd %%ymm10, %%ymm" hi ", %%ymm" hi "\n\t"                \
  "vcvtdq2ps %%ymm" lo ", %%ymm" lo "\n\t"                        \
  "vcvtdq2ps %%ymm" hi ", %%ymm" hi "\n\t"                        \
  "vbroadcastss " saddr ", %%ymm15\n\t"                           \
  "vmulps (%[d]), %%ymm15, %%ymm12\n\t"                           \
  "vmulps 32(%[d]), %%ymm15, %%ymm13\n\t"                         \
  "vfmadd213ps " off "(%[acc]), %%ymm12, %%ymm" lo "\n\t"         \
  "vfmadd213ps " off "+32(%[acc]), %%ymm13, %%ymm" hi "\n\t"      \
  "vbroadcastss " baddr ", %%ymm15\n\t"                           \
  "vfmadd231ps (%[m]), %%ymm15, %%ymm" lo "\n\t"                  \
  "vfmadd231ps 32(%[m]), %%ymm15, %%ymm" hi "\n\t"                \
  "vmovups %%ymm" lo ", " off "(%[acc])\n\t"                      \
  "vmovups %%ymm" hi ", " off "+32(%[acc])\n\t"

// w: the group's first step; q: row 0's activations, kp bytes per row; s, b: row 0's
// block scales and bsums, nblk per row; d, m: the group's block 0 scales and minimums (16
// floats per block); pf: the Prefetch's share, lines_per_step per block.
void block_4x1_avx2(float* acc, const uint8_t* w, const int8_t* q, int64_t kp, const float* s, const float* b,
                    int64_t nblk, const float* d, const float* m, Prefetch pf) {
  const int8_t* q3 = q + 3 * kp;
  const float* s3 = s + 3 * nblk;
  const float* b3 = b + 3 * nblk;
  const int64_t ns = nblk * 4, lps = pf.lines_per_step;
  const char* p = pf.p;
  const char* pend = pf.p ? pf.end : nullptr;
  int64_t n = nblk, tmp;
  asm volatile(
      "vpcmpeqw %%ymm10, %%ymm10, %%ymm10\n\t" "vpsrlw $15, %%ymm10, %%ymm10\n\t"  // 1 in every int16
      "1:\n\t"
      SLUICE_ASM_PREFETCH_SHARE
      SLUICE_W4_STEP(0, SLUICE_W4_FIRST) SLUICE_W4_STEP(1, SLUICE_W4_ADD) SLUICE_W4_STEP(2, SLUICE_W4_ADD)
      SLUICE_W4_STEP(3, SLUICE_W4_ADD) SLUICE_W4_STEP(4, SLUICE_W4_ADD) SLUICE_W4_STEP(5, SLUICE_W4_ADD)
      SLUICE_W4_STEP(6, SLUICE_W4_ADD) SLUICE_W4_STEP(7, SLUICE_W4_ADD)
      SLUICE_W4_SCALE("(%[s])", "(%[b])", "0", "1", "0")
      SLUICE_W4_SCALE("(%[s],%[ns],1)", "(%[b],%[ns],1)", "2", "3", "64")
      SLUICE_W4_SCALE("(%[s],%[ns],2)", "(%[b],%[ns],2)", "4", "5", "128")
      SLUICE_W4_SCALE("(%[s3])", "(%[b3])", "6", "7", "192")
      "add $512, %[w]\n\t" "add $32, %[q]\n\t" "add $32, %[q3]\n\t" "add $4, %[s]\n\t" "add $4, %[s3]\n\t"
      "add $4, %[b]\n\t" "add $4, %[b3]\n\t" "add $64, %[d]\n\t" "add $64, %[m]\n\t"
      "decq %[n]\n\t" "jnz 1b\n\t"
      : [w] "+r"(w), [q] "+r"(q), [q3] "+r"(q3), [s] "+r"(s), [s3] "+r"(s3), [b] "+r"(b), [b3] "+r"(b3),
        [d] "+r"(d), [m] "+r"(m), [p] "+r"(p), [n] "+m"(n), [tmp] "=&r"(tmp)
      : [kp] "r"(kp), [ns] "r"(ns), [acc] "r"(acc), [pend] "m"(pend), [lps] "m"(lps)
      : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "xmm12",
        "xmm13", "xmm15", "memory", "cc");
}
#undef SLUICE_W4_ROW
#undef SLUICE_W4_FIRST
#undef SLUICE_W4_ADD
#undef SLUICE_W4_STEP
#undef SLUICE_W4_SCALE
constexpr bool kAsmBlock = true;
#else
constexpr bool kAsmBlock = false;
inline void block_4x1_avx2(float*, const uint8_t*, const int8_t*, int64_t, const float*, const float*, int64_t,
                           const float*, const float*, Prefetch) {}
#endif

// R rows x C groups of 16 columns over the whole of K, then the bias and the store.
// wd, wm: [NB][nblk][16] block scales and minimums, float32, or (S = c10::Half, nibbles
// only) float16 where every one is a float16 value: the same float32 arithmetic on the same
// values, from two bytes a scale instead of four. Nib: w is nibble-packed (two steps a
// vector, w4a8_pack_nibbles), else a byte a weight; the same sums either way. Wide: bytes
// of q up to 254 (see the top of the file).
template <int R, int C, bool Nib = false, bool Wide = false, bool Five = false, typename S = float>
void block(const uint8_t* w, int64_t KS, const S* wd, const S* wm, const Acts& x, int64_t nb0,
           const float* bias, int64_t N, bool out_f32, void* out, int64_t m0, Prefetch pf,
           const float* moff = nullptr) {
  static_assert(std::is_same_v<S, float> || Nib, "float16 scales are read by the nibble path only");
  const int64_t Kp = x.Kp, nblk = Kp / kBlock;
  __m512 acc[R][C];
  bool asm_block = false;
  if constexpr (std::is_same_v<S, float>) asm_block = kAsmBlock && !Nib && !Wide && !Five && R == 4 && C == 1 && nblk > 0;
  if (asm_block) {
    alignas(64) float sums[R * kLanes] = {};
    if constexpr (std::is_same_v<S, float>)
      block_4x1_avx2(sums, w + nb0 * KS * kLanes * 4, x.q + m0 * Kp, Kp, x.scales + m0 * nblk, x.bsums + m0 * nblk,
                     nblk, wd + nb0 * nblk * kLanes, wm + nb0 * nblk * kLanes, pf);
    for (int r = 0; r < R; ++r) acc[r][0] = _mm512_load_ps(sums + r * kLanes);
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nblk; ++b) {
      pf.step();
      __m512i isum[R][C];
      for (int r = 0; r < R; ++r) {
        __m512i start = _mm512_setzero_si512();
#if defined(SLUICE_SIGN_TRICK)
        // q - 127 was multiplied: 127 * sum(qx) back (boff is 128 * that sum).
        if constexpr (Wide) start = _mm512_set1_epi32(x.boff[(m0 + r) * nblk + b] / 128 * kWideOffset);
#endif
        for (int c = 0; c < C; ++c) isum[r][c] = start;
      }
      if constexpr (Five) {
        for (int s = 0; s < kStepsPerBlock; s += 2) {
          const int64_t step = b * kStepsPerBlock + s;
          for (int c = 0; c < C; ++c) {
            const uint8_t* unit = w + ((nb0 + c) * (KS / kStepsPerBlock) + b) * kFiveBlockBytes;
            const __m512i v = _mm512_loadu_si512(unit + (s / 2) * kLanes * 4);
            const __m512i bits = _mm512_loadu_si512(unit + 4 * kLanes * 4);
            const __m512i w0 = merge_fifth(v, bits, s), w1 = merge_fifth(srli16(v, 4), bits, s + 1);
            for (int r = 0; r < R; ++r) {
              isum[r][c] = dot4(isum[r][c], w0, x.q + (m0 + r) * Kp + step * 4);
              isum[r][c] = dot4(isum[r][c], w1, x.q + (m0 + r) * Kp + step * 4 + 4);
            }
          }
        }
      } else if constexpr (Wide) {
        for (int s = 0; s < kStepsPerBlock; ++s) {
          const int64_t step = b * kStepsPerBlock + s;
          __m512i wv[C];
          for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + ((nb0 + c) * KS + step) * kLanes * 4);
          for (int r = 0; r < R; ++r) {
            const int64_t at = (m0 + r) * Kp + step * 4;
            for (int c = 0; c < C; ++c) dpbusd(isum[r][c], wv[c], x.q + at, x.qabs ? x.qabs + at : nullptr);  // simd.h
          }
        }
      } else if constexpr (Nib) {
        for (int s = 0; s < kStepsPerBlock; s += 2) {
          const int64_t step = b * kStepsPerBlock + s;
          __m512i w0[C], w1[C];
          for (int c = 0; c < C; ++c)
            unpack_nibbles(_mm512_loadu_si512(w + ((nb0 + c) * (KS / 2) + step / 2) * kLanes * 4), w0[c], w1[c]);
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) {
              isum[r][c] = dot4(isum[r][c], w0[c], x.q + (m0 + r) * Kp + step * 4);
              isum[r][c] = dot4(isum[r][c], w1[c], x.q + (m0 + r) * Kp + step * 4 + 4);
            }
        }
      } else {
        for (int s = 0; s < kStepsPerBlock; ++s) {
          const int64_t step = b * kStepsPerBlock + s;
          __m512i wv[C];
          for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + ((nb0 + c) * KS + step) * kLanes * 4);
          for (int r = 0; r < R; ++r)
            for (int c = 0; c < C; ++c) isum[r][c] = dot4(isum[r][c], wv[c], x.q + (m0 + r) * Kp + step * 4);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(x.scales[(m0 + r) * nblk + b]);
        const __m512 bs = _mm512_set1_ps(x.bsums[(m0 + r) * nblk + b]);
        for (int c = 0; c < C; ++c) {
          const int64_t at = ((nb0 + c) * nblk + b) * kLanes;
          const __m512 dv = load16(wd + at);
          const __m512 t = _mm512_mul_ps(dv, sx);
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), t, acc[r][c]);
          const __m512 mv = ((Wide || Five) && moff) ? _mm512_mul_ps(dv, _mm512_loadu_ps(moff + (nb0 + c) * kLanes))
                                           : load16(wm + at);
          acc[r][c] = _mm512_fmadd_ps(mv, bs, acc[r][c]);
        }
      }
    }
  }
  store_rows<R, C>(acc, bias, N, out_f32, out, m0, nb0);
}

template <int R, bool Nib = false, bool Wide = false, bool Five = false, typename S = float>
void block_cols(int C, const uint8_t* w, int64_t KS, const S* wd, const S* wm, const Acts& x, int64_t nb0,
                const float* bias, int64_t N, bool out_f32, void* out, int64_t m0, Prefetch pf,
                const float* moff = nullptr) {
  if constexpr (kCols == 1) {  // one group at a time (the same sums, in the same order)
    for (int c = 0; c < C; ++c)
      block<R, 1, Nib, Wide, Five, S>(w, KS, wd, wm, x, nb0 + c, bias, N, out_f32, out, m0, pf, moff);
  } else {
    switch (C) {
      case 1: return block<R, 1, Nib, Wide, Five, S>(w, KS, wd, wm, x, nb0, bias, N, out_f32, out, m0, pf, moff);
      case 2: return block<R, 2, Nib, Wide, Five, S>(w, KS, wd, wm, x, nb0, bias, N, out_f32, out, m0, pf, moff);
      default: return block<R, kCols, Nib, Wide, Five, S>(w, KS, wd, wm, x, nb0, bias, N, out_f32, out, m0, pf, moff);
    }
  }
}

// d, m: [N, nblk] float32 (m may be [N]: one -offset per row) -> [N/16][nblk][16] (m:
// [N/16][16]), N padded to 16 with zeros.
std::tuple<at::Tensor, at::Tensor> pack_scales(at::Tensor d, at::Tensor m, int64_t N, int64_t nblk) {
  const int64_t NB = (N + kLanes - 1) / kLanes;
  const bool row_offsets = m.dim() == 1;
  d = d.to(at::kFloat).contiguous();
  m = m.to(at::kFloat).contiguous();
  auto od = at::zeros({NB, nblk, kLanes}, d.options());
  auto om = row_offsets ? at::zeros({NB, kLanes}, d.options()) : at::zeros({NB, nblk, kLanes}, d.options());
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t b = 0; b < nblk; ++b) {
      od.data_ptr<float>()[((n / kLanes) * nblk + b) * kLanes + n % kLanes] = d.data_ptr<float>()[n * nblk + b];
      if (!row_offsets)
        om.data_ptr<float>()[((n / kLanes) * nblk + b) * kLanes + n % kLanes] = m.data_ptr<float>()[n * nblk + b];
    }
    if (row_offsets) om.data_ptr<float>()[n] = m.data_ptr<float>()[n];
  }
  return {od, om};
}

}  // namespace

// q: [N, K] uint8 in 0..15 (or, wide, 0..254), d, m: [N, ceil(K / 32)] float32 ->
// (weights [N/16][Kp/4][16][4], uint8, or int8 when wide; scales [N/16][nblk][16], minimums
// likewise), N padded to 16 (with zero scales and minimums) and K to a whole block (with
// zero weights).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_pack_weight(at::Tensor q, at::Tensor d, at::Tensor m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "4-bit weights must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), Kp = padded_k(K), nblk = Kp / kBlock, NB = (N + kLanes - 1) / kLanes;
  const int qmax = q.numel() == 0 ? 0 : q.max().item<uint8_t>();
  TORCH_CHECK(qmax <= 254, "block weights must lie in 0..254");
  const bool wide = qmax > 15;
  const bool row_offsets = m.dim() == 1;  // symmetric rows: one -offset per row (see the top)
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == nblk &&
              (m.sizes() == d.sizes() || (row_offsets && m.size(0) == N && wide)),
              "one scale and one minimum per row and block of 32 (or, for wide weights, one -offset per row)");
  q = q.contiguous();
  const int64_t KS = Kp / 4;
  auto out = at::zeros({NB, KS, kLanes, 4}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int offset = wide ? kWideOffset : 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      dst[(((n / kLanes) * KS + k / 4) * kLanes + n % kLanes) * 4 + k % 4] =
          static_cast<uint8_t>(src[n * K + k] - offset);
  auto [od, om] = pack_scales(d, m, N, nblk);
  return {wide ? out.view(at::kChar) : out, od, om};
}

// q: [N, K] uint8 in 0..31, d and m as w4a8_pack_weight takes them (m may be one -offset
// per row) -> (weights [N/16][nblk][5][16][4]: per block the four nibble vectors, then the
// fifth bits (see the top of the file); its scales and minimums as w4a8_pack_weight's).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_pack_5bit(at::Tensor q, at::Tensor d, at::Tensor m) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "5-bit weights must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), Kp = padded_k(K), nblk = Kp / kBlock, NB = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(q.numel() == 0 || q.max().item<uint8_t>() <= 31, "5-bit weights must lie in 0..31");
  TORCH_CHECK(d.dim() == 2 && d.size(0) == N && d.size(1) == nblk &&
              (m.sizes() == d.sizes() || (m.dim() == 1 && m.size(0) == N)),
              "one scale and one minimum per row and block of 32 (or one -offset per row)");
  q = q.contiguous();
  auto out = at::zeros({NB, nblk, 5, kLanes, 4}, q.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t nb = n / kLanes, lane = n % kLanes;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t b = k / kBlock, s = (k % kBlock) / 4;
      uint8_t* unit = dst + (nb * nblk + b) * kFiveBlockBytes;
      const uint8_t v = src[n * K + k];
      unit[((s / 2) * kLanes + lane) * 4 + k % 4] |= static_cast<uint8_t>((v & 0x0F) << (4 * (s % 2)));
      unit[(4 * kLanes + lane) * 4 + k % 4] |= static_cast<uint8_t>((v >> 4) << s);
    }
  }
  auto [od, om] = pack_scales(d, m, N, nblk);
  return {out, od, om};
}

// Rows `ids` of the weights w4a8_pack_weight packed (from the byte layout, or from the
// nibbles where the byte layout was left empty), as float32 q * d + m: an embedding table
// read from the LM head's packed copy instead of a second one.
at::Tensor w4a8_rows(at::Tensor ids, at::Tensor packed, at::Tensor d, at::Tensor m, int64_t K,
                     c10::optional<at::Tensor> nibbles) {
  if (m.scalar_type() == at::kChar) {  // Q6_K's form (q6k.cpp): int8 scales per 16 k
    TORCH_CHECK(nibbles.has_value(), "Q6_K weights need their top bits");
    return q6k_rows(ids, packed, *nibbles, d, m, K);
  }
  const int64_t Kp = padded_k(K), KS = Kp / 4, nblk = Kp / kBlock, NB = d.size(0);
  const bool five = packed.dim() == 5;
  const bool bytes = packed.numel() > 0 && !five, wide = packed.scalar_type() == at::kChar;
  TORCH_CHECK(!five || packed.numel() == NB * nblk * kFiveBlockBytes, "5-bit weights made by w4a8_pack_5bit expected");
  TORCH_CHECK(bytes || five || nibbles.has_value(), "no weights to read");
  const bool row_offsets = m.dim() == 2;
  const bool half = d.scalar_type() == at::kHalf;  // float16 scales (w4a8_half_scales)
  TORCH_CHECK((d.scalar_type() == at::kFloat || (half && !row_offsets)) && m.scalar_type() == d.scalar_type() &&
              d.is_contiguous() && d.numel() == NB * nblk * kLanes &&
              (m.sizes() == d.sizes() || (row_offsets && m.numel() == NB * kLanes)) && m.is_contiguous(),
              "block scales and minimums packed by w4a8_pack_weight expected");
  const uint8_t* wb = bytes ? static_cast<const uint8_t*>(packed.data_ptr()) : nullptr;
  const uint8_t* wn = bytes || five ? nullptr : nibbles->data_ptr<uint8_t>();
  const uint8_t* w5 = five ? packed.data_ptr<uint8_t>() : nullptr;
  const int offset = wide ? kWideOffset : 0;
  const float* dp = half ? nullptr : d.data_ptr<float>();
  const float* mp = half ? nullptr : m.data_ptr<float>();
  const c10::Half* hd = half ? d.data_ptr<c10::Half>() : nullptr;
  const c10::Half* hm = half ? m.data_ptr<c10::Half>() : nullptr;
  return gather_rows(ids, NB * kLanes, K, d.options(), [&](int64_t n, int64_t k) {
    const int64_t nb = n / kLanes, lane = n % kLanes, step = k / 4;
    int q;
    if (w5) {
      const uint8_t* unit = w5 + (nb * nblk + k / kBlock) * kFiveBlockBytes;
      const int64_t s = step % kStepsPerBlock;
      q = ((unit[((s / 2) * kLanes + lane) * 4 + k % 4] >> (4 * (s % 2))) & 0x0F) |
          (((unit[(4 * kLanes + lane) * 4 + k % 4] >> s) & 1) << 4);
    } else if (wb) {
      q = wb[((nb * KS + step) * kLanes + lane) * 4 + k % 4];
      if (wide) q = static_cast<uint8_t>(q + offset);
    } else {
      const uint8_t v = wn[((nb * (KS / 2) + step / 2) * kLanes + lane) * 4 + k % 4];
      q = step % 2 ? v >> 4 : v & 0x0F;
    }
    const int64_t at = (nb * nblk + k / kBlock) * kLanes + lane;
    if (half) return static_cast<float>(q) * static_cast<float>(hd[at]) + static_cast<float>(hm[at]);
    const float mv = row_offsets ? dp[at] * mp[n] : mp[at];
    return static_cast<float>(q) * dp[at] + mv;
  });
}

// The byte layout [NB][KS][16][4] -> two steps a byte, [NB][KS / 2][16][4]: byte (j, l, i)
// holds step 2j's weight in its low nibble and step 2j + 1's in its high one. Half the
// bytes a few-row step reads, where reading the weights is what a step costs.
at::Tensor w4a8_pack_nibbles(at::Tensor packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.size(1) % 2 == 0,
              "weights packed by w4a8_pack_weight expected");
  auto p = packed.contiguous().view({packed.size(0), packed.size(1) / 2, 2, kLanes, 4});
  return p.select(2, 0).bitwise_or(p.select(2, 1).bitwise_left_shift(4)).contiguous();
}

int64_t w4a8_nibble_max_rows() { return kNibbleMaxRows; }

// Block scales and minimums packed by w4a8_pack_weight as float16, where every one of them
// is a float16 value (a GGUF's Q4_0 / Q4_1 blocks, w4a8's own fit), else None: a quarter of
// the bytes a 4-bit weight costs (0.625 bytes a weight against 0.75) with the same values.
c10::optional<std::tuple<at::Tensor, at::Tensor>> w4a8_half_scales(at::Tensor d, at::Tensor m) {
  if (d.scalar_type() != at::kFloat || m.scalar_type() != at::kFloat || m.sizes() != d.sizes()) return c10::nullopt;
  at::Tensor hd = d.to(at::kHalf).contiguous(), hm = m.to(at::kHalf).contiguous();
  if (!hd.to(at::kFloat).equal(d) || !hm.to(at::kFloat).equal(m)) return c10::nullopt;
  return std::make_tuple(hd, hm);
}

at::Tensor linear_w4a8_rows(const W8A8Rows& x, at::Tensor packed, at::Tensor d, at::Tensor m, int64_t N,
                            c10::optional<at::Tensor> bias, bool out_float32, c10::optional<at::Tensor> nibbles,
                            c10::optional<at::Tensor> nibble_scales) {
  if (m.scalar_type() == at::kChar) {  // Q6_K's form (q6k.cpp): int8 scales per 16 k
    TORCH_CHECK(nibbles.has_value(), "Q6_K weights need their top bits");
    return linear_q6k_rows(x, packed, *nibbles, d, m, N, bias, out_float32);
  }
  auto out = at::empty({x.q.size(0), N}, x.q.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  linear_w4a8_rows_into(x, packed, d, m, N, bias, nibbles, out, nibble_scales);
  return out;
}

void linear_w4a8_rows_into(const W8A8Rows& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                           int64_t N, const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& nibbles,
                           at::Tensor& out, const c10::optional<at::Tensor>& nibble_scales) {
  if (m.scalar_type() == at::kChar) {  // Q6_K's form: its own kernel allocates (not a hot path)
    TORCH_CHECK(nibbles.has_value(), "Q6_K weights need their top bits");
    out.copy_(linear_q6k_rows(x, packed, *nibbles, d, m, N, bias, out.scalar_type() == at::kFloat));
    return;
  }
  const bool out_float32 = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == x.q.size(0) && out.size(1) == N &&
              (out_float32 || out.scalar_type() == at::kBFloat16), "out must be [M, N] bfloat16 or float32");
  const int64_t M = x.q.size(0), Kp = padded_k(x.K), KS = Kp / 4, nblk = Kp / kBlock, NB = (N + kLanes - 1) / kLanes;
  const bool wide = packed.scalar_type() == at::kChar, five = packed.dim() == 5;
  // Nibbles at every row count where the byte layout was not kept (this build's choice
  // above, or a caller's that puts memory first: quantization='gguf').
  const bool use_nibbles = !wide && !five && nibbles.has_value() && (M <= kNibbleMaxRows || packed.numel() == 0);
  if (five) {
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(0) == NB &&
                packed.size(1) == nblk, "5-bit weights packed by w4a8_pack_5bit, matching [N, K], expected");
  } else if (!use_nibbles) {  // (where nibbles serve every row count, the byte layout may be left empty)
    TORCH_CHECK((wide || packed.scalar_type() == at::kByte) && packed.dim() == 4 && packed.size(0) == NB &&
                packed.size(1) == KS, "weights packed by w4a8_pack_weight, matching [N, K], expected");
  }
  const bool row_offsets = (wide || five) && m.dim() == 2;
  const bool half = d.scalar_type() == at::kHalf;  // float16 scales (w4a8_half_scales): nibbles only
  TORCH_CHECK((d.scalar_type() == at::kFloat || (half && use_nibbles)) && d.is_contiguous() &&
              d.numel() == NB * nblk * kLanes && m.scalar_type() == d.scalar_type() && m.is_contiguous() &&
              (m.numel() == d.numel() || (row_offsets && m.numel() == NB * kLanes)),
              "block scales and minimums packed by w4a8_pack_weight (float16 ones only with nibbles) expected");
  const auto bias_f = float_or_empty(bias);
  if (M == 0) return;
  const uint8_t* w = use_nibbles ? nullptr : static_cast<const uint8_t*>(packed.data_ptr());
#if defined(SLUICE_SIGN_TRICK)
  const Acts acts{x.q.data_ptr<int8_t>(), x.scales.data_ptr<float>(), x.bsums.data_ptr<float>(), Kp,
                  x.qabs.data_ptr<int8_t>(), x.boff.data_ptr<int32_t>()};
#else
  const Acts acts{x.q.data_ptr<int8_t>(), x.scales.data_ptr<float>(), x.bsums.data_ptr<float>(), Kp};
#endif
  const float* wd = half ? nullptr : d.data_ptr<float>();
  const float* wm = half ? nullptr : m.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  void* op = out.data_ptr();
  // The nibbles' own float16 copy of the scales, where a build keeps the byte layout (and
  // its float32 scales) for bigger steps: the AVX2 builds.
  const bool own_half = !half && use_nibbles && nibble_scales.has_value() && nibble_scales->defined();
  if (own_half)
    TORCH_CHECK(nibble_scales->scalar_type() == at::kHalf && nibble_scales->is_contiguous() &&
                nibble_scales->dim() == 4 && nibble_scales->size(0) == 2 && nibble_scales->numel() == 2 * d.numel(),
                "nibble scales: [2, ...] float16, d's and m's (w4a8_half_scales, stacked)");
  if (use_nibbles) {
    TORCH_CHECK(nibbles->scalar_type() == at::kByte && nibbles->is_contiguous() && nibbles->dim() == 4 &&
                nibbles->size(0) == NB && nibbles->size(1) * 2 == KS, "nibbles made by w4a8_pack_nibbles expected");
    const uint8_t* wn = nibbles->data_ptr<uint8_t>();
    auto run = [&](const auto* sd, const auto* sm) {  // float32 or float16 scales
      for_panels(M, NB, kCols, kRows, wn, KS * kLanes * 2, nblk, [&](int64_t nb0, int C, int64_t m0, int r, Prefetch pf) {
        switch (r) {
          case 1: return block_cols<1, true>(C, wn, KS, sd, sm, acts, nb0, bp, N, out_float32, op, m0, pf);
          case 2: return block_cols<2, true>(C, wn, KS, sd, sm, acts, nb0, bp, N, out_float32, op, m0, pf);
          default: return block_cols<kRows, true>(C, wn, KS, sd, sm, acts, nb0, bp, N, out_float32, op, m0, pf);
        }
      });
    };
    if (own_half) {
      const c10::Half* hd = nibble_scales->data_ptr<c10::Half>();
      run(hd, hd + d.numel());
    } else if (half) {
      run(d.data_ptr<c10::Half>(), m.data_ptr<c10::Half>());
    } else {
      run(wd, wm);
    }
    return;
  }
  if (five) {
    // One column group by kFiveRows rows: unpacking a step costs as much as a few of its
    // dot products, so the more rows share it the better (AVX-512's 32 registers hold 8
    // rows of sums and accumulators; at 32 rows 5-10% faster than 4 x 3, docs/lab-notes.md).
    const float* moff = row_offsets ? wm : nullptr;
    for_panels(M, NB, 1, kFiveRows, w, nblk * kFiveBlockBytes, nblk, [&](int64_t nb0, int, int64_t m0, int r, Prefetch pf) {
      switch (r) {
        case 1: return block<1, 1, false, false, true>(w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf, moff);
        case 2: return block<2, 1, false, false, true>(w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf, moff);
        default:
          return block<kFiveRows, 1, false, false, true>(w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf, moff);
      }
    });
    return;
  }
  if (wide) {
    const float* moff = row_offsets ? wm : nullptr;
    for_panels(M, NB, kCols, kRows, w, KS * kLanes * 4, nblk, [&](int64_t nb0, int C, int64_t m0, int r, Prefetch pf) {
      switch (r) {
        case 1: return block_cols<1, false, true>(C, w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf, moff);
        case 2: return block_cols<2, false, true>(C, w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf, moff);
        default:
          return block_cols<kRows, false, true>(C, w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf, moff);
      }
    });
    return;
  }
  // As linear_w8a8_rows: threads split column panels, each reused by every row block.
  for_panels(M, NB, kCols, kRows, w, KS * kLanes * 4, nblk, [&](int64_t nb0, int C, int64_t m0, int r, Prefetch pf) {
    switch (r) {
      case 1: return block_cols<1>(C, w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf);
      case 2: return block_cols<2>(C, w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf);
      default: return block_cols<kRows>(C, w, KS, wd, wm, acts, nb0, bp, N, out_float32, op, m0, pf);
    }
  });
}

// x: [M, K] bf16, quantized per block of 32 as linear_w8a8 does; then linear_w4a8_rows.
at::Tensor linear_w4a8(at::Tensor x, at::Tensor packed, at::Tensor d, at::Tensor m, int64_t N,
                       c10::optional<at::Tensor> bias, bool out_float32, c10::optional<at::Tensor> nibbles,
                       c10::optional<at::Tensor> nibble_scales) {
  return linear_w4a8_rows(w8a8_quantize(x), packed, d, m, N, bias, out_float32, nibbles, nibble_scales);
}

}  // namespace sluice
