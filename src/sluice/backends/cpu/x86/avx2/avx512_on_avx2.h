// The AVX-512 intrinsics sluice's kernels use, written on AVX2 + FMA + F16C: each 512-bit
// vector is two 256-bit halves, each 16-bit mask a plain integer. The AVX2 build of the
// kernels (-march=x86-64-v3, SLUICE_AVX2) is the same source as the AVX-512 build with
// this header in front, so both builds run one algorithm: the same blocking, the same
// reduction order per output element (batch invariance carries over), the same int32
// sums in the int8 kernels.
//
// The names are mapped with macros after <immintrin.h> (as SIMDe's "native aliases"
// do): `__m512` in kernel code becomes `sl512_ps`, `_mm512_add_ps` becomes
// `sl512_add_ps`, and so on; only what the kernels call is here.
//
// Where the AVX2 result can differ from AVX-512's: vdpbf16ps treats denormal inputs as
// zero and flushes denormal outputs; here they are kept (bf16 denormals, below 1e-38, do
// not occur in weights or activations). Every other function gives the same bits.
//
// Cost: vpdpbusd (64 byte products) becomes vpsignb + vpmaddubsw + vpmaddwd + two adds
// per half (one VEX vpdpbusd per half in the avx2_vnni build, -mavxvnni -DSLUICE_AVX_VNNI);
// vdpbf16ps two FMAs and two shifts per half. The kernels' register blocks are sized per
// build for AVX2's 16 vector registers (kRows and kMaxSums in batch_invariant.cpp and
// w8a8.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define SL_INLINE inline __attribute__((always_inline))

struct sl512_ps {
  __m256 lo, hi;
};
struct sl512_si {
  __m256i lo, hi;
};

// -- masks as vectors ------------------------------------------------------------------
// Lanes of 8 x 32 bits, all ones where bit i of m is set.
SL_INLINE __m256i sl_mask8_epi32(unsigned m) {
  const __m256i bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(m)), bits), bits);
}
SL_INLINE __m256i sl_mask_lo(uint16_t m) { return sl_mask8_epi32(m & 0xFF); }
SL_INLINE __m256i sl_mask_hi(uint16_t m) { return sl_mask8_epi32(m >> 8); }

// -- set, load, store ------------------------------------------------------------------
SL_INLINE sl512_ps sl512_set1_ps(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
SL_INLINE sl512_ps sl512_setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
SL_INLINE sl512_si sl512_setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
SL_INLINE sl512_si sl512_set1_epi32(int x) { return {_mm256_set1_epi32(x), _mm256_set1_epi32(x)}; }
SL_INLINE sl512_si sl512_set1_epi64(long long x) { return {_mm256_set1_epi64x(x), _mm256_set1_epi64x(x)}; }
SL_INLINE sl512_si sl512_setr_epi32(int a0, int a1, int a2, int a3, int a4, int a5, int a6, int a7, int a8, int a9,
                                    int a10, int a11, int a12, int a13, int a14, int a15) {
  return {_mm256_setr_epi32(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_setr_epi32(a8, a9, a10, a11, a12, a13, a14, a15)};
}
SL_INLINE sl512_ps sl512_loadu_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_loadu_ps(f), _mm256_loadu_ps(f + 8)};
}
SL_INLINE sl512_ps sl512_load_ps(const void* p) {
  const float* f = static_cast<const float*>(p);
  return {_mm256_load_ps(f), _mm256_load_ps(f + 8)};
}
SL_INLINE void sl512_storeu_ps(void* p, sl512_ps v) {
  float* f = static_cast<float*>(p);
  _mm256_storeu_ps(f, v.lo);
  _mm256_storeu_ps(f + 8, v.hi);
}
SL_INLINE void sl512_store_ps(void* p, sl512_ps v) {
  float* f = static_cast<float*>(p);
  _mm256_store_ps(f, v.lo);
  _mm256_store_ps(f + 8, v.hi);
}
SL_INLINE sl512_si sl512_loadu_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
SL_INLINE sl512_si sl512_load_si512(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_load_si256(q), _mm256_load_si256(q + 1)};
}
SL_INLINE void sl512_storeu_si512(void* p, sl512_si v) {
  __m256i* q = static_cast<__m256i*>(p);
  _mm256_storeu_si256(q, v.lo);
  _mm256_storeu_si256(q + 1, v.hi);
}
// Masked loads and stores never touch a masked-off lane's memory (vmaskmovps).
SL_INLINE sl512_ps sl512_maskz_loadu_ps(uint16_t m, const void* p) {
  const float* f = static_cast<const float*>(p);
  if (m == 0xFFFF) return sl512_loadu_ps(p);
  return {_mm256_maskload_ps(f, sl_mask_lo(m)), _mm256_maskload_ps(f + 8, sl_mask_hi(m))};
}
SL_INLINE void sl512_mask_storeu_ps(void* p, uint16_t m, sl512_ps v) {
  float* f = static_cast<float*>(p);
  if (m == 0xFFFF) return sl512_storeu_ps(p, v);
  _mm256_maskstore_ps(f, sl_mask_lo(m), v.lo);
  _mm256_maskstore_ps(f + 8, sl_mask_hi(m), v.hi);
}
// 16-bit lanes (AVX-512 BW/VL): AVX2 has no 16-bit masked moves, so a partial mask (a
// row's tail only) goes lane by lane.
SL_INLINE __m256i sl256_maskz_loadu_epi16(uint16_t m, const void* p) {
  if (m == 0xFFFF) return _mm256_loadu_si256(static_cast<const __m256i*>(p));
  alignas(32) uint16_t buf[16] = {0};
  const uint16_t* s = static_cast<const uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) buf[i] = s[i];
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(buf));
}
SL_INLINE void sl256_mask_storeu_epi16(void* p, uint16_t m, __m256i v) {
  if (m == 0xFFFF) return _mm256_storeu_si256(static_cast<__m256i*>(p), v);
  alignas(32) uint16_t buf[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(buf), v);
  uint16_t* d = static_cast<uint16_t*>(p);
  for (int i = 0; i < 16; ++i)
    if (m >> i & 1) d[i] = buf[i];
}

// -- float arithmetic ------------------------------------------------------------------
#define SL_PS2(name, op)                                                           \
  SL_INLINE sl512_ps name(sl512_ps a, sl512_ps b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SL_PS2(sl512_add_ps, _mm256_add_ps)
SL_PS2(sl512_sub_ps, _mm256_sub_ps)
SL_PS2(sl512_mul_ps, _mm256_mul_ps)
SL_PS2(sl512_div_ps, _mm256_div_ps)
SL_PS2(sl512_max_ps, _mm256_max_ps)
SL_PS2(sl512_min_ps, _mm256_min_ps)
#undef SL_PS2
SL_INLINE sl512_ps sl512_fmadd_ps(sl512_ps a, sl512_ps b, sl512_ps c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
SL_INLINE sl512_ps sl512_abs_ps(sl512_ps a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
SL_INLINE sl512_si sl512_abs_epi32(sl512_si a) { return {_mm256_abs_epi32(a.lo), _mm256_abs_epi32(a.hi)}; }
SL_INLINE sl512_ps sl512_roundscale_ps(sl512_ps a, const int imm) {  // scale 0 only (imm < 16)
  return {_mm256_round_ps(a.lo, imm & 0xF), _mm256_round_ps(a.hi, imm & 0xF)};
}
// a * 2^n for integral n in the normal range (exp16's use: n in [-126, 127]), exact as vscalefps.
SL_INLINE sl512_ps sl512_scalef_ps(sl512_ps a, sl512_ps n) {
  auto pow2 = [](__m256 e) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(e), _mm256_set1_epi32(127)), 23));
  };
  return {_mm256_mul_ps(a.lo, pow2(n.lo)), _mm256_mul_ps(a.hi, pow2(n.hi))};
}
SL_INLINE uint16_t sl512_cmp_ps_mask(sl512_ps a, sl512_ps b, const int pred) {
  return static_cast<uint16_t>(_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, pred)) |
                               _mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, pred)) << 8);
}
SL_INLINE sl512_ps sl512_maskz_mov_ps(uint16_t m, sl512_ps a) {
  return {_mm256_and_ps(a.lo, _mm256_castsi256_ps(sl_mask_lo(m))),
          _mm256_and_ps(a.hi, _mm256_castsi256_ps(sl_mask_hi(m)))};
}
SL_INLINE float sl512_cvtss_f32(sl512_ps a) { return _mm256_cvtss_f32(a.lo); }

// Reductions in the order GCC's AVX-512 ones use (256 + 256, 128 + 128, then within the
// last 128 bits), so sums are the same bits as the AVX-512 build's.
SL_INLINE float sl_reduce128_add(__m128 x) {
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
SL_INLINE float sl512_reduce_add_ps(sl512_ps a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  return sl_reduce128_add(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
}
SL_INLINE float sl512_reduce_max_ps(sl512_ps a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
  return _mm_cvtss_f32(x);
}
SL_INLINE int sl512_reduce_add_epi32(sl512_si a) {
  const __m256i s = _mm256_add_epi32(a.lo, a.hi);
  __m128i x = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0x4E));
  x = _mm_add_epi32(x, _mm_shuffle_epi32(x, 0xB1));
  return _mm_cvtsi128_si32(x);
}

// -- shuffles --------------------------------------------------------------------------
SL_INLINE sl512_ps sl512_shuffle_ps(sl512_ps a, sl512_ps b, const int imm) {  // within 128-bit lanes
  return {_mm256_shuffle_ps(a.lo, b.lo, imm), _mm256_shuffle_ps(a.hi, b.hi, imm)};
}
// 128-bit lanes: two of a's, then two of b's.
SL_INLINE sl512_ps sl512_shuffle_f32x4(sl512_ps a, sl512_ps b, const int imm) {
  // vperm2f128 picks each 128-bit half of its result from (x.lo, x.hi, y.lo, y.hi) = 0..3.
  return {_mm256_permute2f128_ps(a.lo, a.hi, (imm & 3) | ((imm >> 2 & 3) << 4)),
          _mm256_permute2f128_ps(b.lo, b.hi, (imm >> 4 & 3) | ((imm >> 6 & 3) << 4))};
}
// r[i] = a[idx[i] % 16].
SL_INLINE __m256 sl_permute16(__m256 lo, __m256 hi, __m256i idx) {
  const __m256 from_hi = _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28));  // bit 3 -> sign
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx), from_hi);
}
SL_INLINE sl512_ps sl512_permutexvar_ps(sl512_si idx, sl512_ps a) {
  return {sl_permute16(a.lo, a.hi, idx.lo), sl_permute16(a.lo, a.hi, idx.hi)};
}
// r[i] = (idx[i] & 16 ? b : a)[idx[i] % 16].
SL_INLINE sl512_ps sl512_permutex2var_ps(sl512_ps a, sl512_si idx, sl512_ps b) {
  auto half = [&](__m256i ix) {
    const __m256 from_b = _mm256_castsi256_ps(_mm256_slli_epi32(ix, 27));  // bit 4 -> sign
    return _mm256_blendv_ps(sl_permute16(a.lo, a.hi, ix), sl_permute16(b.lo, b.hi, ix), from_b);
  };
  return {half(idx.lo), half(idx.hi)};
}

// -- integers --------------------------------------------------------------------------
#define SL_SI2(name, op)                                                           \
  SL_INLINE sl512_si name(sl512_si a, sl512_si b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
SL_SI2(sl512_add_epi32, _mm256_add_epi32)
SL_SI2(sl512_sub_epi32, _mm256_sub_epi32)
SL_SI2(sl512_add_epi64, _mm256_add_epi64)
SL_SI2(sl512_and_si512, _mm256_and_si256)
SL_SI2(sl512_unpacklo_epi8, _mm256_unpacklo_epi8)   // AVX-512 unpacks work per 128-bit lane too
SL_SI2(sl512_unpackhi_epi8, _mm256_unpackhi_epi8)
SL_SI2(sl512_unpacklo_epi16, _mm256_unpacklo_epi16)
SL_SI2(sl512_unpackhi_epi16, _mm256_unpackhi_epi16)
#undef SL_SI2
SL_INLINE sl512_si sl512_slli_epi32(sl512_si a, const int n) {
  return {_mm256_slli_epi32(a.lo, n), _mm256_slli_epi32(a.hi, n)};
}
SL_INLINE sl512_si sl512_srai_epi32(sl512_si a, const int n) {
  return {_mm256_srai_epi32(a.lo, n), _mm256_srai_epi32(a.hi, n)};
}

// -- conversions -----------------------------------------------------------------------
SL_INLINE sl512_ps sl512_castsi512_ps(sl512_si a) { return {_mm256_castsi256_ps(a.lo), _mm256_castsi256_ps(a.hi)}; }
SL_INLINE sl512_si sl512_castps_si512(sl512_ps a) { return {_mm256_castps_si256(a.lo), _mm256_castps_si256(a.hi)}; }
SL_INLINE __m256i sl512_castsi512_si256(sl512_si a) { return a.lo; }
SL_INLINE sl512_si sl512_castsi256_si512(__m256i a) { return {a, _mm256_setzero_si256()}; }
SL_INLINE sl512_si sl512_inserti64x4(sl512_si a, __m256i b, const int i) { return i ? sl512_si{a.lo, b} : sl512_si{b, a.hi}; }
SL_INLINE __m256i sl512_extracti64x4_epi64(sl512_si a, const int i) { return i ? a.hi : a.lo; }
SL_INLINE sl512_ps sl512_cvtepi32_ps(sl512_si a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
SL_INLINE sl512_si sl512_cvtps_epi32(sl512_ps a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
SL_INLINE sl512_si sl512_cvtepu16_epi32(__m256i a) {
  return {_mm256_cvtepu16_epi32(_mm256_castsi256_si128(a)), _mm256_cvtepu16_epi32(_mm256_extracti128_si256(a, 1))};
}
SL_INLINE sl512_si sl512_cvtepi8_epi16(__m256i a) {
  return {_mm256_cvtepi8_epi16(_mm256_castsi256_si128(a)), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(a, 1))};
}
SL_INLINE sl512_si sl512_cvtepi8_epi32(__m128i a) {
  return {_mm256_cvtepi8_epi32(a), _mm256_cvtepi8_epi32(_mm_unpackhi_epi64(a, a))};
}
// 16 x int32 -> 16 x int16 in order (the packs work per 128-bit lane; the permute puts
// the four 64-bit quarters back in order).
SL_INLINE __m256i sl_pack_order(__m256i packed) { return _mm256_permute4x64_epi64(packed, 0xD8); }
SL_INLINE __m256i sl512_cvtepi32_epi16(sl512_si a) {  // truncating, as vpmovdw
  const __m256i m = _mm256_set1_epi32(0xFFFF);
  return sl_pack_order(_mm256_packus_epi32(_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)));
}
SL_INLINE __m128i sl512_cvtepi32_epi8(sl512_si a) {  // truncating, as vpmovdb
  const __m256i m = _mm256_set1_epi32(0xFF);
  const __m256i w = sl_pack_order(_mm256_packus_epi32(_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)));
  return _mm_packus_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}
SL_INLINE __m128i sl512_cvtsepi32_epi8(sl512_si a) {  // saturating, as vpmovsdb
  const __m256i w = sl_pack_order(_mm256_packs_epi32(a.lo, a.hi));
  return _mm_packs_epi16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1));
}

// float32 -> bfloat16 as vcvtneps2bf16: round to nearest even, NaN kept quiet, and zero
// or denormal inputs to a zero of their sign.
SL_INLINE __m256i sl_bf16_bits(__m256 x) {  // 8 lanes, the bf16 in each dword's low half
  const __m256i b = _mm256_castps_si256(x);
  const __m256i exp = _mm256_and_si256(b, _mm256_set1_epi32(0x7F800000));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x40));
  const __m256i tiny = _mm256_cmpeq_epi32(exp, _mm256_setzero_si256());
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(0x8000));
  __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
  return _mm256_blendv_epi8(r, sign, tiny);
}
SL_INLINE __m256i sl512_cvtneps_pbh(sl512_ps a) {  // 16 bf16
  return sl_pack_order(_mm256_packus_epi32(sl_bf16_bits(a.lo), sl_bf16_bits(a.hi)));
}
SL_INLINE sl512_si sl512_cvtne2ps_pbh(sl512_ps a, sl512_ps b) {  // b's 16 first, then a's
  return {sl512_cvtneps_pbh(b), sl512_cvtneps_pbh(a)};
}

// -- dot products ----------------------------------------------------------------------
// vdpbf16ps: acc += a.odd * b.odd, then += a.even * b.even, per 32-bit lane (each bf16
// pair's product is exact in float32, so an FMA rounds as the instruction does).
SL_INLINE __m256 sl_dpbf16(__m256 acc, __m256i a, __m256i b) {
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(a, hi)), _mm256_castsi256_ps(_mm256_and_si256(b, hi)), acc);
  return _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(a, 16)), _mm256_castsi256_ps(_mm256_slli_epi32(b, 16)),
                         acc);
}
SL_INLINE sl512_ps sl512_dpbf16_ps(sl512_ps acc, sl512_si a, sl512_si b) {
  return {sl_dpbf16(acc.lo, a.lo, b.lo), sl_dpbf16(acc.hi, a.hi, b.hi)};
}
// vpdpbusd: acc += four unsigned bytes of a times four signed bytes of b, per lane, for
// a's bytes in 1..255 and b's in -127..127 (what the kernels store: int8 values + 128,
// times int8 values). vpmaddubsw alone would saturate (255 * 127 * 2 > 32767), so a is
// taken as a - 128 (|a - 128| <= 127: pairs stay below 32767 on vpmaddubsw's sign trick)
// and 128 * (b's four bytes' sum) is added back: the same int32 sums exactly.
// The avx2_vnni build (SLUICE_AVX_VNNI: AVX2 CPUs with AVX-VNNI, Alder Lake and later)
// has the instruction itself, on 256 bits (VEX vpdpbusd): the same int32 sums.
SL_INLINE __m256i sl_dpbusd(__m256i acc, __m256i a, __m256i b) {
#if defined(SLUICE_AVX_VNNI)
  return _mm256_dpbusd_avx_epi32(acc, a, b);
#else
  const __m256i ones16 = _mm256_set1_epi16(1);
  const __m256i as = _mm256_xor_si256(a, _mm256_set1_epi8(static_cast<char>(0x80)));          // a - 128, signed
  const __m256i prod = _mm256_maddubs_epi16(_mm256_abs_epi8(b), _mm256_sign_epi8(as, b));     // (a - 128) * b, pairs
  const __m256i bsum = _mm256_maddubs_epi16(_mm256_set1_epi8(1), b);                          // b, pairs
  const __m256i dot = _mm256_madd_epi16(prod, ones16);
  return _mm256_add_epi32(acc, _mm256_add_epi32(dot, _mm256_slli_epi32(_mm256_madd_epi16(bsum, ones16), 7)));
#endif
}
SL_INLINE sl512_si sl512_dpbusd_epi32(sl512_si acc, sl512_si a, sl512_si b) {
  return {sl_dpbusd(acc.lo, a.lo, b.lo), sl_dpbusd(acc.hi, a.hi, b.hi)};
}
SL_INLINE sl512_si sl512_dpwssd_epi32(sl512_si acc, sl512_si a, sl512_si b) {  // int16 pairs, exact
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}

// -- gathers ---------------------------------------------------------------------------
// 8 int32 from base + index * scale for the 8 int64 indices, masked lanes from src.
SL_INLINE __m256i sl512_mask_i64gather_epi32(__m256i src, uint8_t m, sl512_si index, const void* base, const int scale) {
  const __m256i mask = sl_mask8_epi32(m);
  const int* b = static_cast<const int*>(base);
  const __m128i lo = _mm256_mask_i64gather_epi32(_mm256_castsi256_si128(src), b, index.lo,
                                                 _mm256_castsi256_si128(mask), scale);
  const __m128i hi = _mm256_mask_i64gather_epi32(_mm256_extracti128_si256(src, 1), b, index.hi,
                                                 _mm256_extracti128_si256(mask, 1), scale);
  return _mm256_set_m128i(hi, lo);
}

// -- the names the kernels use ---------------------------------------------------------
// (#undef first: GCC defines some of them, _mm512_setr_epi32 for one, as macros.)
#undef __m512
#define __m512 sl512_ps
#undef __m512i
#define __m512i sl512_si
#undef __m512bh
#define __m512bh sl512_si
#undef __m256bh
#define __m256bh __m256i
#undef _mm512_set1_ps
#define _mm512_set1_ps sl512_set1_ps
#undef _mm512_setzero_ps
#define _mm512_setzero_ps sl512_setzero_ps
#undef _mm512_setzero_si512
#define _mm512_setzero_si512 sl512_setzero_si512
#undef _mm512_set1_epi32
#define _mm512_set1_epi32 sl512_set1_epi32
#undef _mm512_set1_epi64
#define _mm512_set1_epi64 sl512_set1_epi64
#undef _mm512_setr_epi32
#define _mm512_setr_epi32 sl512_setr_epi32
#undef _mm512_loadu_ps
#define _mm512_loadu_ps sl512_loadu_ps
#undef _mm512_load_ps
#define _mm512_load_ps sl512_load_ps
#undef _mm512_storeu_ps
#define _mm512_storeu_ps sl512_storeu_ps
#undef _mm512_store_ps
#define _mm512_store_ps sl512_store_ps
#undef _mm512_loadu_si512
#define _mm512_loadu_si512 sl512_loadu_si512
#undef _mm512_load_si512
#define _mm512_load_si512 sl512_load_si512
#undef _mm512_storeu_si512
#define _mm512_storeu_si512 sl512_storeu_si512
#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps sl512_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps sl512_mask_storeu_ps
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 sl256_maskz_loadu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 sl256_mask_storeu_epi16
#undef _mm512_add_ps
#define _mm512_add_ps sl512_add_ps
#undef _mm512_sub_ps
#define _mm512_sub_ps sl512_sub_ps
#undef _mm512_mul_ps
#define _mm512_mul_ps sl512_mul_ps
#undef _mm512_div_ps
#define _mm512_div_ps sl512_div_ps
#undef _mm512_max_ps
#define _mm512_max_ps sl512_max_ps
#undef _mm512_min_ps
#define _mm512_min_ps sl512_min_ps
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps sl512_fmadd_ps
#undef _mm512_abs_ps
#define _mm512_abs_ps sl512_abs_ps
#undef _mm512_abs_epi32
#define _mm512_abs_epi32 sl512_abs_epi32
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps sl512_roundscale_ps
#undef _mm512_scalef_ps
#define _mm512_scalef_ps sl512_scalef_ps
#undef _mm512_cmp_ps_mask
#define _mm512_cmp_ps_mask sl512_cmp_ps_mask
#undef _mm512_maskz_mov_ps
#define _mm512_maskz_mov_ps sl512_maskz_mov_ps
#undef _mm512_cvtss_f32
#define _mm512_cvtss_f32 sl512_cvtss_f32
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps sl512_reduce_add_ps
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps sl512_reduce_max_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 sl512_reduce_add_epi32
#undef _mm512_shuffle_ps
#define _mm512_shuffle_ps sl512_shuffle_ps
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4 sl512_shuffle_f32x4
#undef _mm512_permutexvar_ps
#define _mm512_permutexvar_ps sl512_permutexvar_ps
#undef _mm512_permutex2var_ps
#define _mm512_permutex2var_ps sl512_permutex2var_ps
#undef _mm512_add_epi32
#define _mm512_add_epi32 sl512_add_epi32
#undef _mm512_sub_epi32
#define _mm512_sub_epi32 sl512_sub_epi32
#undef _mm512_add_epi64
#define _mm512_add_epi64 sl512_add_epi64
#undef _mm512_unpacklo_epi8
#define _mm512_unpacklo_epi8 sl512_unpacklo_epi8
#undef _mm512_unpackhi_epi8
#define _mm512_unpackhi_epi8 sl512_unpackhi_epi8
#undef _mm512_unpacklo_epi16
#define _mm512_unpacklo_epi16 sl512_unpacklo_epi16
#undef _mm512_unpackhi_epi16
#define _mm512_unpackhi_epi16 sl512_unpackhi_epi16
#undef _mm512_slli_epi32
#define _mm512_slli_epi32 sl512_slli_epi32
#undef _mm512_srai_epi32
#define _mm512_srai_epi32 sl512_srai_epi32
#undef _mm512_and_si512
#define _mm512_and_si512 sl512_and_si512
#undef _mm512_castsi512_ps
#define _mm512_castsi512_ps sl512_castsi512_ps
#undef _mm512_castps_si512
#define _mm512_castps_si512 sl512_castps_si512
#undef _mm512_castsi512_si256
#define _mm512_castsi512_si256 sl512_castsi512_si256
#undef _mm512_castsi256_si512
#define _mm512_castsi256_si512 sl512_castsi256_si512
#undef _mm512_inserti64x4
#define _mm512_inserti64x4 sl512_inserti64x4
#undef _mm512_extracti64x4_epi64
#define _mm512_extracti64x4_epi64 sl512_extracti64x4_epi64
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps sl512_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 sl512_cvtps_epi32
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 sl512_cvtepu16_epi32
#undef _mm512_cvtepi8_epi16
#define _mm512_cvtepi8_epi16 sl512_cvtepi8_epi16
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 sl512_cvtepi8_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 sl512_cvtepi32_epi16
#undef _mm512_cvtepi32_epi8
#define _mm512_cvtepi32_epi8 sl512_cvtepi32_epi8
#undef _mm512_cvtsepi32_epi8
#define _mm512_cvtsepi32_epi8 sl512_cvtsepi32_epi8
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh sl512_cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh sl512_cvtne2ps_pbh
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps sl512_dpbf16_ps
#undef _mm512_dpbusd_epi32
#define _mm512_dpbusd_epi32 sl512_dpbusd_epi32
#undef _mm512_dpwssd_epi32
#define _mm512_dpwssd_epi32 sl512_dpwssd_epi32
#undef _mm512_mask_i64gather_epi32
#define _mm512_mask_i64gather_epi32 sl512_mask_i64gather_epi32
