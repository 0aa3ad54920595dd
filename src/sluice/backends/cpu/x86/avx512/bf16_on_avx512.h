// AVX-512 BF16's three instructions, written on AVX-512 F/BW: the avx512_vnni build of
// the kernels (-march=x86-64-v4 -mavx512vnni, no -mavx512bf16) for the AVX-512 CPUs that
// have VNNI but not BF16: Intel's Cascade Lake, Ice Lake, Tiger Lake and Rocket Lake. Every
// other instruction the kernels use (512-bit FMAs, masks, VNNI's vpdpbusd) runs natively;
// without this header those CPUs would run the AVX2 build, half the vector width and
// vpdpbusd in four instructions.
//
// The names are mapped with macros after <immintrin.h>, as avx2/avx512_on_avx2.h does:
// `_mm512_dpbf16_ps` in kernel code becomes `sl_dpbf16_ps`, `__m512bh` becomes `__m512i`.
//
// The same bits as the instructions, and as the AVX2 build's versions of them (which
// tests/*/test_isa_builds* compare with this build), but for denormals: vdpbf16ps treats
// denormal inputs as zero and flushes denormal outputs, and here they are kept (bf16
// denormals, below 1e-38, do not occur in weights or activations).
//
// Cost: vdpbf16ps (32 bf16 products) becomes two FMAs, an and and a shift per operand
// (an operand used by several sums, a broadcast activation pair or a loaded weight pair,
// is split once when the compiler sees it); vcvtneps2bf16 eight instructions.
#pragma once

#include <immintrin.h>

#define SL_INLINE inline __attribute__((always_inline))

// vdpbf16ps: acc += a.odd * b.odd, then += a.even * b.even, per 32-bit lane (each bf16
// pair's product is exact in float32, so an FMA rounds as the instruction does).
SL_INLINE __m512 sl_dpbf16_ps(__m512 acc, __m512i a, __m512i b) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)),
                        acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                         acc);
}

// float32 -> bfloat16 as vcvtneps2bf16: round to nearest even, NaN kept quiet, and zero
// or denormal inputs to a zero of their sign. 16 lanes, each bf16 in its dword's low half.
SL_INLINE __m512i sl_bf16_bits(__m512 x) {
  const __m512i b = _mm512_castps_si512(x);
  const __m512i top = _mm512_srli_epi32(b, 16);
  const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
  return _mm512_mask_mov_epi32(r, _mm512_testn_epi32_mask(b, _mm512_set1_epi32(0x7F800000)),
                               _mm512_and_si512(top, _mm512_set1_epi32(0x8000)));
}
SL_INLINE __m256i sl_cvtneps_pbh(__m512 a) {  // 16 bf16 (vpmovdw: every lane fits 16 bits)
  return _mm512_cvtepi32_epi16(sl_bf16_bits(a));
}
SL_INLINE __m512i sl_cvtne2ps_pbh(__m512 a, __m512 b) {  // b's 16 first, then a's
  return _mm512_inserti64x4(_mm512_castsi256_si512(sl_cvtneps_pbh(b)), sl_cvtneps_pbh(a), 1);
}

// -- the names the kernels use ---------------------------------------------------------
#undef __m512bh
#define __m512bh __m512i
#undef __m256bh
#define __m256bh __m256i
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps sl_dpbf16_ps
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh sl_cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh sl_cvtne2ps_pbh
