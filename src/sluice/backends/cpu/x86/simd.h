// Helpers shared by the CPU kernels: float32 lanes from float32 or bfloat16 memory, a
// 16-lane exp, and the weight-panel prefetch of the linear kernels.
//
// The kernels are written in AVX-512 intrinsics and built once per ISA (backends/cpu/x86/
// __init__.py): natively for AVX-512 with BF16 and VNNI; for AVX-512 with VNNI alone,
// where avx512/bf16_on_avx512.h provides BF16's three instructions; and for AVX2 + FMA +
// F16C with SLUICE_AVX2 defined, where avx2/avx512_on_avx2.h provides every one on
// 256-bit halves. This header is the one place that tells the builds apart.
#pragma once

#include "aten.h"
#include "team.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#if defined(SLUICE_AVX2)
#include "avx2/avx512_on_avx2.h"
#elif defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include "avx512/bf16_on_avx512.h"
#else
#error "sluice's kernels build for AVX-512 with VNNI (BF16 native or not) or, with -DSLUICE_AVX2, for AVX2 + FMA + F16C"
#endif

// The plain AVX2 build (no AVX-VNNI) has no vpdpbusd: its int8 dot products use
// vpmaddubsw's sign trick, vpmaddubsw(|x|, y * sign(x)) then vpmaddwd by ones, on operands
// laid out for it (w8a8.cpp, the int8-cache scores of paged_attention.cpp).
#if defined(SLUICE_AVX2) && !defined(SLUICE_AVX_VNNI)
#define SLUICE_SIGN_TRICK 1
#endif

namespace sluice {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// 16 lanes of float32 from float32 or bfloat16 memory (bf16 -> f32 is a 16-bit shift).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// 16 lanes of float32 from float16 memory (exact: every float16 is a float32).
inline __m512 load16(const c10::Half* p) {
#if defined(SLUICE_AVX2)
  const __m128i* h = reinterpret_cast<const __m128i*>(p);
  return {_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
#else
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#endif
}

// acc += w . x over 4 k per lane, w unsigned bytes and x 4 signed bytes broadcast, for
// operands whose pairs of products cannot saturate vpmaddubsw's int16 (w4a8's weights in
// 0..15; head_w8a7's activations in -63..63): there AVX2 has it in two instructions and a
// widening add, without the sign trick.
inline __m512i dot4_unsigned_signed(__m512i acc, __m512i w, const int8_t* x4) {
  int32_t x;
  std::memcpy(&x, x4, sizeof(x));
#if defined(SLUICE_SIGN_TRICK)
  const __m256i xv = _mm256_set1_epi32(x), ones = _mm256_set1_epi16(1);
  acc.lo = _mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(w.lo, xv), ones));
  acc.hi = _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(w.hi, xv), ones));
  return acc;
#else
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x));
#endif
}

#if defined(SLUICE_SIGN_TRICK)
// The int8 kernels' product of 4 k per lane (w8a8.cpp; w4a8.cpp's wide weights).
// AVX2 has no vpdpbusd. There the weights are packed signed (|q| <= 127, not q + 128),
// and per half llama.cpp's sign trick, vpmaddubsw(|x|, q * sign(x)) (pairs below 2^15),
// then vpmaddwd by ones: acc += sum(q * x), 4 k per lane. |x| comes from the quantized
// rows (qabs), made once per row rather than once per row and column group. What the
// offset would have added (w8a8: 128 * sum(x) over the block, its `boff`) is where each
// block's sums start, so a block's int32 sum is vpdpbusd's exactly and the bits are the
// AVX-512 build's. Per 32 products: vpsignb, vpmaddubsw, vpmaddwd, vpaddd, two of them on the
// multiply pipes, as in the ceiling's loop (machine_limits.py).
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* x4, const int8_t* xabs4) {
  int32_t x, xa;
  std::memcpy(&x, x4, sizeof(x));
  std::memcpy(&xa, xabs4, sizeof(xa));
  const __m256i xv = _mm256_set1_epi32(x), xabs = _mm256_set1_epi32(xa), ones = _mm256_set1_epi16(1);
  acc.lo = _mm256_add_epi32(acc.lo, _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(w.lo, xv)), ones));
  acc.hi = _mm256_add_epi32(acc.hi, _mm256_madd_epi16(_mm256_maddubs_epi16(xabs, _mm256_sign_epi8(w.hi, xv)), ones));
}
#elif defined(SLUICE_AVX_VNNI)
// acc += w (unsigned bytes) . x (signed bytes), 4 per lane: VEX vpdpbusd on each half.
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* x4, const int8_t* /*xabs4: the sign trick's*/) {
  int32_t x;
  std::memcpy(&x, x4, sizeof(x));
  acc = _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x));
}
#else
// acc += w (unsigned bytes) . x (signed bytes), 4 per lane. Written as asm because GCC
// copies every accumulator to a fresh register around the intrinsic (two extra moves
// per multiply-add in the inner loop, measured ~1.5x slower).
// The four activation bytes are broadcast from memory by the instruction itself.
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* x4, const int8_t* /*xabs4: AVX2's*/) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x4)));
}
#endif

// Bit work on packed weights (w4a8.cpp's 5-bit blocks, q6k.cpp), written once for both
// builds: shifts of 16-bit lanes, and (a & a_mask) | (b & b_mask) for masks with no bit in
// common, one vpternlogd and an and on AVX-512 (the two ands and the or of AVX2).
#if defined(SLUICE_AVX2)
inline __m512i srli16(__m512i v, int n) { return {_mm256_srli_epi16(v.lo, n), _mm256_srli_epi16(v.hi, n)}; }
inline __m512i slli16(__m512i v, int n) { return {_mm256_slli_epi16(v.lo, n), _mm256_slli_epi16(v.hi, n)}; }
inline __m512i merge_bits(__m512i a, __m512i b, int a_mask, int b_mask) {
  const __m256i ma = _mm256_set1_epi32(a_mask), mb = _mm256_set1_epi32(b_mask);
  return {_mm256_or_si256(_mm256_and_si256(a.lo, ma), _mm256_and_si256(b.lo, mb)),
          _mm256_or_si256(_mm256_and_si256(a.hi, ma), _mm256_and_si256(b.hi, mb))};
}
#else
inline __m512i srli16(__m512i v, int n) { return _mm512_srli_epi16(v, n); }
inline __m512i slli16(__m512i v, int n) { return _mm512_slli_epi16(v, n); }
inline __m512i merge_bits(__m512i a, __m512i b, int a_mask, int b_mask) {
  // C ? A : B (0xE4) with C = a_mask, then the bits of neither mask off.
  return _mm512_and_si512(_mm512_ternarylogic_epi32(a, b, _mm512_set1_epi32(a_mask), 0xE4),
                          _mm512_set1_epi32(a_mask | b_mask));
}
#endif

// The block kernels' last step (w4a8.cpp, q6k.cpp): R rows x C groups of 16 float sums,
// plus the bias, stored as float32 or bf16 into out's rows from m0 and columns from group
// nb0, masked at N.
template <int R, int C>
inline void store_rows(__m512 (&acc)[R][C], const float* bias, int64_t N, bool out_f32, void* out, int64_t m0,
                       int64_t nb0) {
  constexpr int64_t lanes = 16;
  const size_t esz = out_f32 ? 4 : 2;
  for (int r = 0; r < R; ++r) {
    char* row = static_cast<char*>(out) + (m0 + r) * N * esz;
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = (nb0 + c) * lanes, left = N - n0;
      const __mmask16 m = left >= lanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      __m512 v = acc[r][c];
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, bias + n0));
      if (out_f32) _mm512_mask_storeu_ps(reinterpret_cast<float*>(row) + n0, m, v);
      else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(row) + n0, m, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

// Block b of 32 values of a bf16 row of K (zeros past K) as two float vectors; returns
// their largest magnitude (what the int8 quantizers scale each block of 32 by).
inline float load_block32(const uint16_t* xr, int64_t K, int64_t b, __m512 v[2]) {
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < 2; ++i) {
    const int64_t k0 = b * 32 + i * 16, left = K - k0;
    const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                        : left > 0 ? static_cast<__mmask16>((1u << left) - 1)
                                   : static_cast<__mmask16>(0);
    v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, xr + k0)), 16));
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  return _mm512_reduce_max_ps(amax);
}

// The inline-asm blocks of the int8 kernels (w8a8.cpp, w4a8.cpp, head_w8a7.cpp), at the
// top of each block of 32 k: this block's share of the next panel's prefetch
// (Prefetch::step), lps lines from p while p < pend (operands p, pend, lps, tmp).
#define SLUICE_ASM_PREFETCH_SHARE                                                 \
  "cmp %[pend], %[p]\n\t" "jae 3f\n\t" "mov %[lps], %[tmp]\n\t"                 \
  "2:\n\t" "prefetcht1 (%[p])\n\t" "add $64, %[p]\n\t" "dec %[tmp]\n\t" "jnz 2b\n\t" \
  "3:\n\t"

// exp for 16 lanes: 2^(x log2 e) = 2^n * 2^f with |f| <= 1/2, 2^f by its degree-6 Taylor
// polynomial (relative error ~1e-7, below float32's own rounding of a softmax sum).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Prefetch of the next work unit's weight panel, spread over the current unit's passes:
// at 32 rows a panel is streamed from memory once and then reused from L2 by every row
// block, and without this the first pass waits on memory while the others wait on nothing.
// Beyond a few passes the panel's first load is a small share of the unit's time (at 256
// rows the prefetch measured slower, 135 vs 126 ms for the 120 layers).
inline constexpr int64_t kPrefetchMaxPasses = 8;
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t lines_per_step = 0;
  inline void step() {
    if (p < end) {
      for (int64_t i = 0; i < lines_per_step; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T1);
      p += 64 * lines_per_step;
    }
  }
  // Pass `pass` of `passes` over a unit of `steps` K steps takes its 1/passes share of
  // the next panel's `lines` cache lines (none when next is null).
  static Prefetch share(const char* next, int64_t lines, int64_t pass, int64_t passes, int64_t steps) {
    Prefetch pf;
    if (next) {
      const int64_t l0 = lines * pass / passes, l1 = lines * (pass + 1) / passes;
      pf.p = next + 64 * l0;
      pf.end = next + 64 * l1;
      pf.lines_per_step = (l1 - l0 + steps - 1) / steps;
    }
    return pf;
  }
};

// An int8 KV cache (--kv-cache-dtype int8): per kv head, each block of bs tokens (bs a
// multiple of 16) is bs float32 scales (one per token, x ~ scale * value) and then bs x D
// bytes, the same bytes in all as bs rows of D + kInt8RowExtra (D a multiple of 4). V's bytes are the signed
// values, row by row. K's are value + 128 (the unsigned operand of vpdpbusd), laid out
// as [bs / 16][D / 4][16 tokens][4 dims]: one 64-byte load is 4 dims of 16 tokens, and
// vpdpbusd against 4 of q's dims broadcast puts 16 tokens' partial dot products in the
// 16 lanes, with no sum across lanes to do.
inline constexpr int64_t kInt8RowExtra = 4;
inline int64_t int8_block_bytes(int64_t bs, int64_t D) { return bs * (D + kInt8RowExtra); }
// Byte offsets within a block of token `off`: its scale, its V row, its K dim d.
inline int64_t int8_scale_at(int64_t off) { return off * 4; }
inline int64_t int8_v_at(int64_t off, int64_t bs, int64_t D) { return bs * 4 + off * D; }
inline int64_t int8_k_at(int64_t off, int64_t d, int64_t bs, int64_t D) {
  return bs * 4 + (off / 16) * 16 * D + (d / 4) * 64 + (off % 16) * 4 + d % 4;
}

// Symmetric int8 quantization of one row of n values, one scale per row: q = x * (127 /
// absmax) rounded to nearest even, scale = absmax / 127 (0 for a row of zeros). The vector
// and scalar paths give the same bits (the same float multiply, the same rounding), and so
// does worker/attention.py's quantize_rows_int8. Returns the scale; *sum (if given) gets sum(q).
template <typename T>
inline float quantize_row_i8(const T* x, int64_t n, int8_t* q, int32_t* sum = nullptr) {
  float amax = 0.f;
  int64_t i = 0;
  __m512 m = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + i)));
  amax = _mm512_reduce_max_ps(m);
  for (; i < n; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t s = 0;
  i = 0;
  const __m512 iv = _mm512_set1_ps(inv);
  __m512i acc = _mm512_setzero_si512();
  for (; i + 16 <= n; i += 16) {
    const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + i), iv));  // MXCSR: nearest even
    acc = _mm512_add_epi32(acc, r);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(r));
  }
  s = _mm512_reduce_add_epi32(acc);
  for (; i < n; ++i) {
    const int32_t r = static_cast<int32_t>(std::nearbyint(to_float(x[i]) * inv));
    q[i] = static_cast<int8_t>(r);
    s += r;
  }
  if (sum) *sum = s;
  return amax / 127.f;
}

// Quantize x (one token's row of one kv head) into its place in an int8 cache block.
template <typename T>
inline void write_int8_k(const T* x, int64_t D, uint8_t* block, int64_t off, int64_t bs) {
  int8_t q[512];
  const float scale = quantize_row_i8(x, D, q);
  for (int64_t d = 0; d < D; ++d) block[int8_k_at(off, d, bs, D)] = static_cast<uint8_t>(static_cast<uint8_t>(q[d]) ^ 0x80);
  std::memcpy(block + int8_scale_at(off), &scale, sizeof(scale));
}
template <typename T>
inline void write_int8_v(const T* x, int64_t D, uint8_t* block, int64_t off, int64_t bs) {
  const float scale = quantize_row_i8(x, D, reinterpret_cast<int8_t*>(block + int8_v_at(off, bs, D)));
  std::memcpy(block + int8_scale_at(off), &scale, sizeof(scale));
}

// Work units (a linear kernel's column panels) over the threads. With `balance`, each
// thread first runs its own contiguous share of the first three quarters, where it can
// prefetch its next panel, then takes the rest one unit at a time from a shared counter.
// A static split alone left one thread idle at the end of the region for 11% of w8a8's
// time at 32 rows on this shared machine (a neighbour, or the server's HTTP thread, slows
// one core at a time); the counter took that to 4% and a c32 step from 34-37 to 31-34 ms.
// Without `balance` (a few rows: bound by reading weights, where every unit needs its
// panel prefetched, measured 7% slower at one row with the counter) the split is static.
// f(begin, end) runs units [begin, end) in order; which thread runs a unit never changes
// its arithmetic, so batch invariance is kept.
inline constexpr int64_t kBalanceRows = 8;
template <typename F>
void parallel_units(int64_t units, bool balance, const F& f) {
  const int64_t nt = std::min<int64_t>(num_threads(), units);
  if (nt <= 1 || in_parallel_region()) {
    f(0, units);
    return;
  }
  if (!balance) {
    sluice::parallel_for(0, units, 1, f);
    return;
  }
  const int64_t share = units * 3 / 4 / nt;
  std::atomic<int64_t> next{share * nt};
  sluice::parallel_for(0, nt, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) f(t * share, (t + 1) * share);
    for (int64_t u; (u = next.fetch_add(1, std::memory_order_relaxed)) < units;) f(u, u + 1);
  });
}


// The column-panel loop of the int8 linear kernels (w8a8.cpp, w4a8.cpp). Rows are cut
// into blocks of max_rows (then 2, then 1); threads split units of `cols` groups of 16
// columns (parallel_units); each unit's weight panel (group_bytes per group) is reused by
// every row block, and the unit's passes prefetch the thread's next panel over `steps`
// steps each (Prefetch: for w8a8's 120 layers, 8 rows 5.9 -> 4.6 ms and 32 rows 13.6 ->
// 11.5-13.6 ms). f(nb0, C, m0, r, pf) runs the r rows from m0 over the C groups from nb0.
template <typename F>
void for_panels(int64_t M, int64_t NB, int cols, int max_rows, const uint8_t* w, int64_t group_bytes, int64_t steps,
                const F& f) {
  std::vector<std::pair<int64_t, int>> rows;  // (first row, rows) of each row block
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const int r = left >= max_rows ? max_rows : left >= 2 ? 2 : 1;
    rows.emplace_back(m0, r);
    m0 += r;
  }
  const int64_t units = (NB + cols - 1) / cols, passes = static_cast<int64_t>(rows.size());
  parallel_units(units, M > kBalanceRows, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t nb0 = u * cols;
      const int C = static_cast<int>(std::min<int64_t>(cols, NB - nb0));
      const char* next = u + 1 < end && passes <= kPrefetchMaxPasses
                             ? reinterpret_cast<const char*>(w + (nb0 + cols) * group_bytes) : nullptr;
      const int64_t next_lines = next ? std::min<int64_t>(cols, NB - nb0 - cols) * group_bytes / 64 : 0;
      for (int64_t p = 0; p < passes; ++p)
        f(nb0, C, rows[p].first, rows[p].second, Prefetch::share(next, next_lines, p, passes, steps));
    }
  });
}

// Rows `ids` ([T] int64) of a packed weight table of `rows` rows and K columns, as float32
// [T, K] (`options`' device): each id checked against the table, then value(n, k) for
// row n's column k, rows spread over the threads. The embedding read from a tied LM
// head's packed copy (w4a8_rows, q6k_rows): a few rows a step, off the hot loops.
template <typename F>
at::Tensor gather_rows(at::Tensor ids, int64_t rows, int64_t K, const at::TensorOptions& options, const F& value) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be [T] int64");
  ids = ids.contiguous();
  const int64_t T = ids.size(0);
  auto out = at::empty({T, K}, options.dtype(at::kFloat));
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < rows, "row out of range");
  float* op = out.data_ptr<float>();
  sluice::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t k = 0; k < K; ++k) op[t * K + k] = value(ip[t], k);
  });
  return out;
}

}  // namespace sluice
