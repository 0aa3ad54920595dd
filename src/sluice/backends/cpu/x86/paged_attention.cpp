// Attention straight from the paged KV cache, on the CPU.
//
// For each (token, kv head) the kernel walks the sequence's block table, so it reads
// each cached K/V row once and never pads to the longest sequence or copies blocks into
// a contiguous buffer (what the torch fallback has to do). Scores, softmax and the
// weighted sum run in float32 whatever the cache dtype. Work is split over (token, kv
// head) pairs with at::parallel_for, i.e. torch's own intra-op threads.
#include "aten.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <limits>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using sluice::to_float;

using sluice::exp16;
using sluice::load16;

// In-place softmax of n floats.
inline void softmax16(float* s, int64_t n) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
  float m = _mm512_reduce_max_ps(mx);
  for (int64_t j = i; j < n; ++j) m = std::max(m, s[j]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  for (i = 0; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), mv));
    _mm512_storeu_ps(s + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + i), mv));
    _mm512_mask_storeu_ps(s + i, k, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
  }
  const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(sum));
  for (i = 0; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
  for (; i < n; ++i) s[i] *= _mm512_cvtss_f32(inv);
}

constexpr int kMaxGroup = 8;    // query heads per kv head handled in registers

// make(G, D) with G = group (1..kMaxGroup) and D = head_dim (64 or 128) as
// std::integral_constant: the routine compiled for that shape; null for other shapes.
template <typename Make>
auto for_shape(int64_t group, int64_t head_dim, const Make& make)
    -> decltype(make(std::integral_constant<int, 1>{}, std::integral_constant<int, 64>{})) {
  auto with_d = [&](auto g) -> decltype(make(g, std::integral_constant<int, 64>{})) {
    if (head_dim == 64) return make(g, std::integral_constant<int, 64>{});
    if (head_dim == 128) return make(g, std::integral_constant<int, 128>{});
    return nullptr;
  };
  switch (group) {
    case 1: return with_d(std::integral_constant<int, 1>{});
    case 2: return with_d(std::integral_constant<int, 2>{});
    case 3: return with_d(std::integral_constant<int, 3>{});
    case 4: return with_d(std::integral_constant<int, 4>{});
    case 5: return with_d(std::integral_constant<int, 5>{});
    case 6: return with_d(std::integral_constant<int, 6>{});
    case 7: return with_d(std::integral_constant<int, 7>{});
    case 8: return with_d(std::integral_constant<int, 8>{});
    default: return nullptr;
  }
}
constexpr int kMaxChunks = 16;  // head_dim / 16: up to 256 (Gemma 3)

// The sum of 16 lanes, for 16 vectors at once: out lane j = the sum of v[j]'s lanes, in
// exactly the pairing _mm512_reduce_add_ps uses (lane i with i + 8, then + 4, + 2, + 1;
// float addition is commutative, so the operands' order within a pair does not matter).
// One vector of 16 scores from ~46 instructions instead of 16 scalar reductions.
inline __m512 reduce_add_16x16(const float (*v)[16]) {
  __m512 w[8], z[4], u[2];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: v[2k][l] + v[2k][l + 8]; lanes 8-15: the same for v[2k + 1]
    const __m512 a = _mm512_load_ps(v[2 * k]), b = _mm512_load_ps(v[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  for (int m = 0; m < 4; ++m)  // quarter Q of z[m]: the four partial sums of key 4m + Q
    z[m] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w[2 * m], w[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int n = 0; n < 2; ++n)  // quarter Q of u[n]: two sums each of keys 8n + Q and 8n + 4 + Q
    u[n] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * n], z[2 * n + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(z[2 * n], z[2 * n + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // Lane 4Q + i now holds key 4i + Q; put key j in lane j.
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, r);
}

// Prefetching for a decode's attention: the K rows of the work item the thread takes next
// (none: k null), to prefetch while it finishes this one. Prompt tokens attend rows that
// their chunk has just written, already in cache, and run without (prefetching measured
// 15-25% slower there).
struct Prefetching {
  bool on = false;
  const void* k = nullptr;  // the next item's K (its kv head), in the cache's own type
  const int64_t* blocks = nullptr;
  int64_t len = 0;
};

// Prefetch one cached row of D values into L2 (T0, into L1, measured slower: the L1's
// few miss buffers then hold the stream back).
constexpr int64_t kAheadRows = 96;
template <int64_t D, typename T>
inline void prefetch_row(const T* p) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < D * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}

// Walks a block table one cached row at a time without a division per row.
template <typename T>
struct RowCursor {
  const T* base;
  const int64_t* blocks;
  int64_t block_size, row_elems, blk = 0, off = 0;
  const T* row() const { return base + (blocks[blk] * block_size + off) * row_elems; }
  void next() {
    if (++off == block_size) { off = 0; ++blk; }
  }
};

// attend_one for G query heads per kv head and head_dim = 16 C, known when compiled: q,
// the K row and the accumulators live in registers. The arithmetic is attend_one's own,
// operation for operation, so the bits are the same.
template <int G, int C, typename T>
void attend_fixed(const float* qf, const T* kh, const T* vh, const int64_t* blocks, int64_t len,
                  int64_t block_size, float* scores, float* acc) {
  constexpr int64_t D = C * 16;
  __m512 q[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) q[g][c] = _mm512_loadu_ps(qf + g * D + c * 16);
  alignas(64) float part[G][16][16];
  RowCursor<T> kc{kh, blocks, block_size, D};
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    for (int j = 0; j < n; ++j, kc.next()) {
      const T* k = kc.row();
      __m512 kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load16(k + c * 16);
      for (int g = 0; g < G; ++g) {
        __m512 sum = _mm512_mul_ps(q[g][0], kv[0]);
        for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(q[g][c], kv[c], sum);
        _mm512_store_ps(part[g][j], sum);
      }
    }
    for (int j = n; j < 16; ++j)
      for (int g = 0; g < G; ++g) _mm512_store_ps(part[g][j], _mm512_setzero_ps());
    const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g) _mm512_mask_storeu_ps(scores + g * len + t0, m, reduce_add_16x16(part[g]));
  }
  for (int g = 0; g < G; ++g) softmax16(scores + g * len, len);
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  RowCursor<T> vc{vh, blocks, block_size, D};
  for (int64_t t = 0; t < len; ++t, vc.next()) {
    const T* v = vc.row();
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * len + t]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + c * 16, a[g][c]);
}

// A bf16 cache's attention on the bf16 dot-product instruction, which multiplies 32
// pairs of bf16 where an FMA takes 16 floats, and needs no widening of K and V to float
// first: about half the instructions of attend_fixed per cached row.
// - Scores: q (rounded to bf16, as the q tensor already is) . k, products exact in float32,
//   summed pairwise per lane then across lanes by reduce_add_16x16; the scale multiplies
//   the sum (q * scale would round again where the scale is not a power of two).
// - Softmax in float32, as attend_fixed.
// - Weighted sum of V: two cached rows at a time, their elements interleaved into pairs
//   (x_d, y_d) against the probability pair (p_t, p_t+1) rounded to bf16, as flash
//   attention does on GPUs (2^-9 relative per weight, far below the bf16 output's own
//   rounding once averaged over the rows).
// Every token of a bf16 batch with this shape goes through this routine, prompt or
// decode, so the batch invariance of paged_attention_varlen is kept.
// q and out: the G query heads' rows, [G, D] contiguous, bf16.
template <int G, int C2>
void attend_bf16(const c10::BFloat16* qp, float scale, const c10::BFloat16* kh, const c10::BFloat16* vh,
                 const int64_t* blocks, int64_t len, int64_t block_size, float* scores, uint16_t* probs,
                 c10::BFloat16* out, const Prefetching& pf) {
  constexpr int64_t D = C2 * 32;
  __m512bh q[G][C2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C2; ++c) q[g][c] = (__m512bh)_mm512_loadu_si512(qp + g * D + c * 32);
  alignas(64) float part[G][16][16];
  const __m512 sv = _mm512_set1_ps(scale);
  RowCursor<c10::BFloat16> kc{kh, blocks, block_size, D};
  // Decode reads a cache far larger than the CPU's caches, block by scattered block, and
  // the hardware prefetcher does not follow a block table (measured: 10 GB/s of the ~27 a
  // sequential read gets). So K is prefetched into L2 kAheadRows rows ahead, V's rows
  // during the K pass (the V pass then finds them in L2), and the next work item's first
  // K rows during the V pass, when memory would otherwise idle: ~20 GB/s.
  RowCursor<c10::BFloat16> kp{kh, blocks, block_size, D}, vp{vh, blocks, block_size, D};
  int64_t ahead = pf.on ? 0 : len;
  for (; ahead < std::min(kAheadRows, len); ++ahead, kp.next()) prefetch_row<D>(kp.row());
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    for (int j = 0; j < n; ++j, kc.next()) {
      if (ahead < len) {
        prefetch_row<D>(kp.row());
        kp.next();
        ++ahead;
      }
      if (pf.on) {
        prefetch_row<D>(vp.row());
        vp.next();
      }
      const c10::BFloat16* k = kc.row();
      __m512bh kv[C2];
      for (int c = 0; c < C2; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(k + c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 sum = _mm512_dpbf16_ps(_mm512_setzero_ps(), q[g][0], kv[0]);
        for (int c = 1; c < C2; ++c) sum = _mm512_dpbf16_ps(sum, q[g][c], kv[c]);
        _mm512_store_ps(part[g][j], sum);
      }
    }
    for (int j = n; j < 16; ++j)
      for (int g = 0; g < G; ++g) _mm512_store_ps(part[g][j], _mm512_setzero_ps());
    const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    for (int g = 0; g < G; ++g)
      _mm512_mask_storeu_ps(scores + g * len + t0, m, _mm512_mul_ps(reduce_add_16x16(part[g]), sv));
  }
  // Probabilities as bf16, one row of len (+ a zero, for pairs) per query head.
  const int64_t plen = (len + 1) & ~int64_t{1};
  for (int g = 0; g < G; ++g) {
    softmax16(scores + g * len, len);
    uint16_t* pg = probs + g * plen;
    pg[plen - 1] = 0;
    for (int64_t i = 0; i < len; i += 16) {
      const int64_t left = len - i;
      const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      _mm256_mask_storeu_epi16(pg + i, m, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, scores + g * len + i)));
    }
  }
  // Accumulators hold dims permuted by the interleave: within each 32-dim chunk c,
  // lo lane 4L + i is dim 8L + i and hi lane 4L + i is dim 8L + 4 + i.
  __m512 lo[G][C2], hi[G][C2];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C2; ++c) lo[g][c] = hi[g][c] = _mm512_setzero_ps();
  RowCursor<c10::BFloat16> vc{vh, blocks, block_size, D};
  RowCursor<c10::BFloat16> nc{static_cast<const c10::BFloat16*>(pf.k), pf.blocks, block_size, D};
  const int64_t nlen = pf.k ? std::min(pf.len, kAheadRows) : 0;
  int64_t npos = 0;
  for (int64_t t = 0; t < len; t += 2) {
    for (int r = 0; r < 2 && npos < nlen; ++r, ++npos, nc.next()) prefetch_row<D>(nc.row());
    const c10::BFloat16* x = vc.row();
    vc.next();
    const c10::BFloat16* y = t + 1 < len ? vc.row() : x;  // odd length: its probability is 0
    vc.next();
    __m512bh vlo[C2], vhi[C2];
    for (int c = 0; c < C2; ++c) {
      const __m512i xa = _mm512_loadu_si512(x + c * 32), ya = _mm512_loadu_si512(y + c * 32);
      vlo[c] = (__m512bh)_mm512_unpacklo_epi16(xa, ya);
      vhi[c] = (__m512bh)_mm512_unpackhi_epi16(xa, ya);
    }
    for (int g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, probs + g * plen + t, sizeof(pair));
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < C2; ++c) {
        lo[g][c] = _mm512_dpbf16_ps(lo[g][c], vlo[c], pp);
        hi[g][c] = _mm512_dpbf16_ps(hi[g][c], vhi[c], pp);
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C2; ++c) {  // rounded to nearest even, as a float -> bf16 cast
      const __m512 a = _mm512_permutex2var_ps(lo[g][c], first, hi[g][c]);
      const __m512 b = _mm512_permutex2var_ps(lo[g][c], second, hi[g][c]);
      _mm512_storeu_si512(out + g * D + c * 32, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

using AttendBf16Fn = void (*)(const c10::BFloat16*, float, const c10::BFloat16*, const c10::BFloat16*,
                              const int64_t*, int64_t, int64_t, float*, uint16_t*, c10::BFloat16*, const Prefetching&);
// The bf16 routine for (group, head_dim), or null: head_dim 64 or 128, 1-8 heads per kv head.
AttendBf16Fn attend_bf16_for(int64_t group, int64_t head_dim) {
  return for_shape(group, head_dim,
                   [](auto g, auto d) -> AttendBf16Fn { return &attend_bf16<decltype(g)::value, decltype(d)::value / 32>; });
}

// Prefetches the first nblocks blocks of the thread's next work item's K, per_step lines a call.
struct NextItemLines {
  const uint8_t* k;
  const int64_t* blocks;
  int64_t block_bytes, nblocks, per_step, blk = 0, byte = 0;
  void step() {
    for (int64_t r = 0; r < per_step && blk < nblocks; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(k + blocks[blk] * block_bytes + byte), _MM_HINT_T1);
      if ((byte += 64) >= block_bytes) byte = 0, ++blk;
    }
  }
};

// attend_int8's weighted sum over one group of 16 V rows (consecutive in a block, D = 16
// C16 bytes each): int16 probability pairs (head g's at probs + g * plen) times the rows'
// int16 pairs on vpdpwssd, exact in int32, then into facc times the group's scale (head
// g's at gscale[g * gstride]). Always all 16 rows: past the context the probabilities are
// 0 and whatever a row holds adds an exact integer 0; with a fixed count GCC unrolls the
// loop and keeps the int32 sums in registers (with a variable one it spilled every sum
// around each multiply-add).
template <int G, int C16>
inline void int8_v_group(const uint8_t* rows, const int16_t* probs, int64_t plen, const float* gscale,
                         int64_t gstride, NextItemLines& next, float (*facc)[C16][16]) {
  constexpr int64_t D = C16 * 16;
  __m512i iacc[G][C16];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C16; ++c) iacc[g][c] = _mm512_setzero_si512();
  next.step();  // before the loop, which GCC unrolls only when it is this small
#pragma GCC unroll 8
  for (int t = 0; t < 16; t += 2) {
    const uint8_t* x = rows + t * D;
    const uint8_t* y = x + D;
    // Per 64 dims: (x_d, y_d) int16 pairs, vector i covering dims (in lane order)
    // 0-7 16-23 | 32-39 48-55 | 8-15 24-31 | 40-47 56-63.
    __m512i v[C16];
    for (int c = 0; c < C16 / 4; ++c) {
      const __m512i xa = _mm512_loadu_si512(x + 64 * c), ya = _mm512_loadu_si512(y + 64 * c);
      const __m512i lo = _mm512_unpacklo_epi8(xa, ya), hi = _mm512_unpackhi_epi8(xa, ya);
      v[4 * c] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(lo));
      v[4 * c + 1] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(lo, 1));
      v[4 * c + 2] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(hi));
      v[4 * c + 3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(hi, 1));
    }
    for (int g = 0; g < G; ++g) {
      int32_t pair;
      std::memcpy(&pair, probs + g * plen + t, sizeof(pair));
      const __m512i pp = _mm512_set1_epi32(pair);
      for (int c = 0; c < C16; ++c) iacc[g][c] = _mm512_dpwssd_epi32(iacc[g][c], v[c], pp);
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 sc = _mm512_set1_ps(gscale[g * gstride]);
    for (int c = 0; c < C16; ++c)
      _mm512_store_ps(facc[g][c], _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[g][c]), sc, _mm512_load_ps(facc[g][c])));
  }
}

// attend_bf16's work over an int8 cache (simd.h describes its blocks), in integers where
// it can be:
// - Scores: each query head's row quantized to int8 as the cache's rows are (one scale
//   per row; qi, with qscale = its scale times the softmax scale and qcorr = 128 sum(qi)),
//   times K's unsigned bytes on vpdpbusd: per 16 tokens, D / 4 instructions a head, each
//   adding 4 dims of all 16 tokens' dot products, with no sums across lanes. The integer
//   sums (exact) less qcorr are sum(qi * k), which the token's scale and then qscale
//   multiply.
// - Softmax in float32. Each probability times its V row's scale, then per 16 tokens
//   quantized to int16 against their largest (scale = max / 32767: 15 bits, finer than
//   the bf16 weights of attend_bf16 for all but the smallest).
// - Weighted sum of V on vpdpwssd: the int8 rows of two tokens interleaved and widened
//   to int16 pairs (x_d, y_d) against the probability pair, summed exactly in int32 per 16
//   tokens; each 16 tokens' sums then go into float32 accumulators times their scale.
// Against a bf16 cache a decode reads 53% of the bytes and runs about half the
// instructions.
template <int G, int C2>
void attend_int8(const int8_t* qi, const float* qscale, const int32_t* qcorr, const uint8_t* kh, const uint8_t* vh,
                 const int64_t* blocks, int64_t len, int64_t bs, float* scores, float* vscales, int16_t* probs,
                 c10::BFloat16* out, const Prefetching& pf) {
  constexpr int64_t D = C2 * 32, Q4 = D / 4, C16 = D / 16;  // Q4: groups of 4 dims; C16: vectors of a row
  const int64_t bb = sluice::int8_block_bytes(bs, D), nblk = (len + bs - 1) / bs;
  auto prefetch_block = [bb](const uint8_t* p) {
    for (int64_t i = 0; i < bb; i += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + i, _MM_HINT_T1);
  };
  // A decode prefetches K kAheadRows tokens ahead and each block's V during the K pass (as
  // attend_bf16 does), and the next work item's K during the V pass.
  const int64_t ahead_blocks = std::max<int64_t>(1, kAheadRows / bs);
  int64_t ahead = pf.on ? 0 : nblk;
  for (; ahead < std::min(ahead_blocks, nblk); ++ahead) prefetch_block(kh + blocks[ahead] * bb);
#if defined(SLUICE_SIGN_TRICK)
  alignas(32) int8_t qabs[G * D];  // |q|, the unsigned operand of the sign trick below
  for (int64_t i = 0; i < G * D; ++i) qabs[i] = static_cast<int8_t>(qi[i] < 0 ? -qi[i] : qi[i]);
#endif
  for (int64_t b = 0; b < nblk; ++b) {
    if (ahead < nblk) prefetch_block(kh + blocks[ahead++] * bb);
    if (pf.on) prefetch_block(vh + blocks[b] * bb);
    const uint8_t* blk = kh + blocks[b] * bb;
    const float* ks = reinterpret_cast<const float*>(blk);
    for (int64_t s = 0; s < bs && b * bs + s < len; s += 16) {
      const int64_t t0 = b * bs + s;
      const uint8_t* kq = blk + bs * 4 + s * D;
      __m512i acc[G];
#if defined(SLUICE_SIGN_TRICK)
      // No vpdpbusd: K's bytes less 128 (the signed values) times q on the sign trick,
      // vpmaddubsw(|q|, k * sign(q)) then vpmaddwd by ones, tokens 0-7 and 8-15 in two
      // halves: 4 instructions per 32 products where the general emulation of vpdpbusd
      // (avx512_on_avx2.h) takes about 10. The int32 sums are sum(q * k) exactly, which is
      // vpdpbusd's sum less qcorr (so qcorr is not taken off below).
      {
        const __m256i ones = _mm256_set1_epi16(1), off = _mm256_set1_epi8(static_cast<char>(0x80));
        __m256i lo[G], hi[G];
        for (int g = 0; g < G; ++g) lo[g] = hi[g] = _mm256_setzero_si256();
        for (int64_t j = 0; j < Q4; ++j) {
          const __m256i k0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kq + j * 64)), off);
          const __m256i k1 =
              _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kq + j * 64 + 32)), off);
          for (int g = 0; g < G; ++g) {
            int32_t q4, a4;
            std::memcpy(&q4, qi + g * D + j * 4, sizeof(q4));
            std::memcpy(&a4, qabs + g * D + j * 4, sizeof(a4));
            const __m256i qv = _mm256_set1_epi32(q4), av = _mm256_set1_epi32(a4);
            lo[g] = _mm256_add_epi32(lo[g], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(k0, qv)), ones));
            hi[g] = _mm256_add_epi32(hi[g], _mm256_madd_epi16(_mm256_maddubs_epi16(av, _mm256_sign_epi8(k1, qv)), ones));
          }
        }
        for (int g = 0; g < G; ++g) acc[g] = {lo[g], hi[g]};
      }
      constexpr bool kCorrected = true;
#else
      for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_si512();
      for (int64_t j = 0; j < Q4; ++j) {
        const __m512i kv = _mm512_loadu_si512(kq + j * 64);
        for (int g = 0; g < G; ++g) {
          int32_t q4;
          std::memcpy(&q4, qi + g * D + j * 4, sizeof(q4));
          acc[g] = _mm512_dpbusd_epi32(acc[g], kv, _mm512_set1_epi32(q4));
        }
      }
      constexpr bool kCorrected = false;
#endif
      const int64_t n = std::min<int64_t>(16, len - t0);
      const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
      const __m512 ksv = _mm512_loadu_ps(ks + s);
      for (int g = 0; g < G; ++g) {
        const __m512i sum = kCorrected ? acc[g] : _mm512_sub_epi32(acc[g], _mm512_set1_epi32(qcorr[g]));
        const __m512 dot = _mm512_cvtepi32_ps(sum);
        _mm512_mask_storeu_ps(scores + g * len + t0, m, _mm512_mul_ps(_mm512_mul_ps(dot, ksv), _mm512_set1_ps(qscale[g])));
      }
    }
  }
  // Probabilities: softmax, times the V rows' scales, int16 per 16 tokens (zero past len).
  for (int64_t b = 0; b < nblk; ++b)
    std::memcpy(vscales + b * bs, vh + blocks[b] * bb, std::min(bs, len - b * bs) * sizeof(float));
  const int64_t ngroups = (len + 15) / 16, plen = ngroups * 16;
  float* gscale = vscales + plen;  // [G][ngroups]
  for (int g = 0; g < G; ++g) {
    softmax16(scores + g * len, len);
    for (int64_t k = 0; k < ngroups; ++k) {
      const int64_t left = len - 16 * k;
      const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, scores + g * len + 16 * k),
                                     _mm512_maskz_loadu_ps(m, vscales + 16 * k));
      const float mx = _mm512_reduce_max_ps(p);
      const float inv = mx > 0.f ? 32767.f / mx : 0.f;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + g * plen + 16 * k),
                          _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(p, _mm512_set1_ps(inv)))));
      gscale[g * ngroups + k] = mx / 32767.f;
    }
  }
  // The float32 sums stay in memory, touched once per 16 tokens: the registers are the
  // int32 sums' (in registers, with GCC spilling every one around each multiply-add).
  alignas(64) float facc[G][C16][16] = {};
  // The next item's K (up to 512 tokens of it), spread over this item's V pass: its K pass
  // then reads L2. (Only its first kAheadRows rows, as attend_bf16 does: 7.8 against 6.1 ms
  // for the 30 layers of a c32 x 280 decode step from memory, measured.)
  const int64_t next_blocks = pf.k ? std::min((pf.len + bs - 1) / bs, (512 + bs - 1) / bs) : 0;
  NextItemLines next{static_cast<const uint8_t*>(pf.k), pf.blocks, bb, next_blocks,
                     (next_blocks * bb / 64 + ngroups - 1) / ngroups};
  for (int64_t k = 0; k < ngroups; ++k) {
    // The group's 16 rows are consecutive in one block (bs is a multiple of 16).
    const uint8_t* rows = vh + blocks[16 * k / bs] * bb + sluice::int8_v_at(16 * k % bs, bs, D);
    int8_v_group<G, C16>(rows, probs + 16 * k, plen, gscale + k, ngroups, next, facc);
  }
  // Lane j of vector c holds dim 64 (c / 4) + kDim[c % 4][j].
  static constexpr int8_t kDim[4][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                                         {32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55},
                                         {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31},
                                         {40, 41, 42, 43, 44, 45, 46, 47, 56, 57, 58, 59, 60, 61, 62, 63}};
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C16; ++c)
      for (int j = 0; j < 16; ++j) out[g * D + 64 * (c / 4) + kDim[c % 4][j]] = c10::BFloat16(facc[g][c][j]);
}

using AttendInt8Fn = void (*)(const int8_t*, const float*, const int32_t*, const uint8_t*, const uint8_t*,
                              const int64_t*, int64_t, int64_t, float*, float*, int16_t*, c10::BFloat16*,
                              const Prefetching&);
// The int8-cache routine for (group, head_dim), or null: head_dim 64 or 128, 1-8 heads per kv head.
AttendInt8Fn attend_int8_for(int64_t group, int64_t head_dim) {
  return for_shape(group, head_dim,
                   [](auto g, auto d) -> AttendInt8Fn { return &attend_int8<decltype(g)::value, decltype(d)::value / 32>; });
}

// The compiled attend_fixed for (group, head_dim), or null: head_dim 64 or 128, 1-8 heads per kv head.
template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, float*, float*);
template <typename T>
AttendFn<T> attend_fixed_for(int64_t group, int64_t head_dim) {
  return for_shape(group, head_dim,
                   [](auto g, auto d) -> AttendFn<T> { return &attend_fixed<decltype(g)::value, decltype(d)::value / 16, T>; });
}

// In-place softmax of n floats, in plain C++ (the paths without AVX-512's softmax16).
inline void softmax_scalar(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}

// The keys at positions start .. start + len - 1 (start > 0: a sliding window's).
template <typename T>
void attend_one(const float* qf, const T* kh, const T* vh, const int64_t* blocks, int64_t len,
                int64_t block_size, int64_t group, int64_t head_dim, float* scores, float* acc,
                int64_t start = 0) {
  // Scores: q . k for every cached token of this sequence, walking its block table.
  const int64_t chunks = head_dim / 16;
  const bool fast = head_dim % 16 == 0 && chunks <= kMaxChunks && group <= kMaxGroup;
  if (fast) {
    for (int64_t t = 0; t < len; ++t) {
      const T* k = kh + (blocks[(start + t) / block_size] * block_size + (start + t) % block_size) * head_dim;
      __m512 kv[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) kv[c] = load16(k + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qf + g * head_dim), kv[0]);
        for (int64_t c = 1; c < chunks; ++c) sum = _mm512_fmadd_ps(_mm512_loadu_ps(qf + g * head_dim + c * 16), kv[c], sum);
        scores[g * len + t] = _mm512_reduce_add_ps(sum);
      }
    }
  } else {
    for (int64_t t = 0; t < len; ++t) {
      const T* k = kh + (blocks[(start + t) / block_size] * block_size + (start + t) % block_size) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        float dot = 0.f;
        for (int64_t i = 0; i < head_dim; ++i) dot += qf[g * head_dim + i] * to_float(k[i]);
        scores[g * len + t] = dot;
      }
    }
  }
  // Softmax per query head, in float32.
  if (fast) {
    for (int64_t g = 0; g < group; ++g) softmax16(scores + g * len, len);
  } else
  for (int64_t g = 0; g < group; ++g) softmax_scalar(scores + g * len, len);
  // Weighted sum of V.
  if (fast) {
    __m512 a[kMaxGroup][kMaxChunks];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c) a[g][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vh + (blocks[(start + t) / block_size] * block_size + (start + t) % block_size) * head_dim;
      __m512 vv[kMaxChunks];
      for (int64_t c = 0; c < chunks; ++c) vv[c] = load16(v + c * 16);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 p = _mm512_set1_ps(scores[g * len + t]);
        for (int64_t c = 0; c < chunks; ++c) a[g][c] = _mm512_fmadd_ps(p, vv[c], a[g][c]);
      }
    }
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(acc + g * head_dim + c * 16, a[g][c]);
  } else {
    std::fill(acc, acc + group * head_dim, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const T* v = vh + (blocks[(start + t) / block_size] * block_size + (start + t) % block_size) * head_dim;
      for (int64_t g = 0; g < group; ++g) {
        const float p = scores[g * len + t];
        for (int64_t i = 0; i < head_dim; ++i) acc[g * head_dim + i] += p * to_float(v[i]);
      }
    }
  }
}

// attend_int8's arithmetic in plain C++ for head sizes and CPUs it has no build for: the
// same scores (the integer dot, then the token's scale, then qscale), softmax and the V
// sum in float32.
void attend_one_int8(const int8_t* qi, const float* qscale, const int32_t* qcorr, const uint8_t* kh,
                     const uint8_t* vh, const int64_t* blocks, int64_t len, int64_t bs, int64_t group,
                     int64_t head_dim, float* scores, float* acc, int64_t start = 0) {
  const int64_t D = head_dim, bb = sluice::int8_block_bytes(bs, D);
  for (int64_t t = 0; t < len; ++t) {
    const uint8_t* blk = kh + blocks[(start + t) / bs] * bb;
    const int64_t off = (start + t) % bs;
    float ks;
    std::memcpy(&ks, blk + sluice::int8_scale_at(off), sizeof(ks));
    for (int64_t g = 0; g < group; ++g) {
      // sum(q * (k + 128)) - 128 sum(q), as attend_int8. (Written as sum(q * (k - 128)),
      // GCC 12's vectoriser fed k - 128 to vpdpbusd's unsigned operand: wrong sums.)
      int32_t dot = 0;
      for (int64_t i = 0; i < D; ++i) dot += qi[g * D + i] * static_cast<int32_t>(blk[sluice::int8_k_at(off, i, bs, D)]);
      scores[g * len + t] = static_cast<float>(dot - qcorr[g]) * ks * qscale[g];
    }
  }
  for (int64_t g = 0; g < group; ++g) softmax_scalar(scores + g * len, len);
  std::fill(acc, acc + group * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const uint8_t* blk = vh + blocks[(start + t) / bs] * bb;
    const int64_t off = (start + t) % bs;
    float vs;
    std::memcpy(&vs, blk + sluice::int8_scale_at(off), sizeof(vs));
    const int8_t* v = reinterpret_cast<const int8_t*>(blk + sluice::int8_v_at(off, bs, D));
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t] * vs;
      for (int64_t i = 0; i < D; ++i) acc[g * D + i] += p * v[i];
    }
  }
}

// body(work, t, h) for every (token t, kv head h) pair, work = t * num_kv_heads + h, whose
// token belongs to a request, over `parts` threads. Thread p of P takes every P-th pair,
// not a contiguous range: the tokens of a prompt chunk attend ever longer contexts, and
// contiguous halves of a chunk would leave one thread a quarter of its work and the other
// three quarters. make_body() runs once per thread and gives it its scratch buffers.
template <typename MakeBody>
void for_each_work(int64_t total, int64_t parts, int64_t num_kv_heads, const std::vector<int64_t>& tok_req,
                   const MakeBody& make_body) {
  sluice::parallel_for(0, parts, 1, [&](int64_t part_begin, int64_t part_end) {
    auto body = make_body();
    for (int64_t part = part_begin; part < part_end; ++part)
      for (int64_t work = part; work < total; work += parts) {
        const int64_t t = work / num_kv_heads, h = work % num_kv_heads;
        if (tok_req[t] >= 0) body(work, t, h);
      }
  });
}

}  // namespace

// Attention for every token of a flat batch, prefill chunks and decodes alike: token t of
// a request whose context after this step is L and which computes q tokens here sits at
// position L - q + i and attends keys 0..that position. Each (token, kv head) runs the
// same attend_one as a decode would, so a token's output is the same bits whether it is
// computed in a prompt chunk of any size or as a decode step, and whatever else shares
// the batch: the batch-invariant attention of deterministic mode. Rows past the last
// request (padding) come out as zeros. window > 0 (a sliding-window layer): a token sees
// only the last `window` keys up to itself; a token with more keys than that runs the plain
// per-token routine from the window's start (the same one whatever the batch, so the
// invariance holds), one with fewer the routine it would run anyway.
at::Tensor paged_attention_varlen(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor query_start,
                                  at::Tensor seq_lens, double scale, int64_t window) {
  check_attention_inputs(q, k_cache, v_cache, window);
  const AttentionPlan plan = attention_plan(block_tables, query_start, seq_lens, q.size(0));
  auto out = at::empty_like(q);
  paged_attention_into(q, k_cache, v_cache, plan, scale, window, out);
  return out;
}

// Each token's request and context length, from the step's block tables, query starts and
// context lengths: the same for every layer of a step.
AttentionPlan attention_plan(const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                             int64_t T) {
  AttentionPlan plan;
  plan.bt = block_tables.to(at::kLong).contiguous();
  plan.qs = query_start.to(at::kLong).contiguous();
  plan.lens = seq_lens.to(at::kLong).contiguous();
  const int64_t num_reqs = plan.lens.size(0);
  TORCH_CHECK(plan.qs.size(0) == num_reqs + 1 && plan.bt.size(0) == num_reqs, "one block table and length per request");
  const int64_t* qsp = plan.qs.data_ptr<int64_t>();
  const int64_t* lp = plan.lens.data_ptr<int64_t>();
  TORCH_CHECK(qsp[num_reqs] <= T, "query_start past the batch");
  // Per token: its request and its context length (position + 1).
  plan.tok_req.assign(T, -1);
  plan.tok_len.assign(T, 0);
  for (int64_t b = 0; b < num_reqs; ++b) {
    const int64_t q_len = qsp[b + 1] - qsp[b];
    TORCH_CHECK(q_len >= 0 && q_len <= lp[b], "request computes more tokens than its context");
    for (int64_t i = 0; i < q_len; ++i) {
      plan.tok_req[qsp[b] + i] = b;
      plan.tok_len[qsp[b] + i] = lp[b] - q_len + i + 1;
    }
  }
  return plan;
}

void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q [tokens, heads, dim], cache [kv_heads, blocks, block, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "contiguous inputs");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  TORCH_CHECK(int8_cache ? q.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kByte &&
                               k_cache.size(3) == q.size(2) + sluice::kInt8RowExtra
                         : q.scalar_type() == k_cache.scalar_type(),
              "q and cache dtypes differ (an int8 cache takes bf16 q, rows of head_dim + 4 bytes)");
  TORCH_CHECK(!int8_cache || (q.size(2) % 4 == 0 && k_cache.size(2) % 16 == 0),
              "an int8 cache takes head_dim a multiple of 4, blocks a multiple of 16 tokens");
  TORCH_CHECK(q.size(1) % k_cache.size(0) == 0, "heads not a multiple of kv heads");
  TORCH_CHECK(window >= 0, "window >= 0 (0: none)");
}

// Attention into out (q's shape and dtype) by a step's plan; rows of tokens that belong to
// no request (padding) are zeroed.
void paged_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const AttentionPlan& plan, double scale, int64_t window, at::Tensor& out) {
  check_attention_inputs(q, k_cache, v_cache, window);
  const int64_t T = q.size(0);
  TORCH_CHECK(static_cast<int64_t>(plan.tok_req.size()) == T, "a plan made for another batch");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type(),
              "out must be contiguous, q's shape and dtype");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  const std::vector<int64_t>& tok_req = plan.tok_req;
  const std::vector<int64_t>& tok_len = plan.tok_len;
  const at::Tensor& bt = plan.bt;
  const int64_t* qsp = plan.qs.data_ptr<int64_t>();
  const int64_t row_bytes = q.size(1) * q.size(2) * static_cast<int64_t>(q.element_size());
  for (int64_t t = 0; t < T; ++t)
    if (tok_req[t] < 0) std::memset(static_cast<char*>(out.data_ptr()) + t * row_bytes, 0, row_bytes);
  const int64_t num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = bt.size(1);
  const float fscale = static_cast<float>(scale);
  const int64_t total = T * num_kv_heads, parts = std::max<int64_t>(1, std::min<int64_t>(sluice::num_threads(), total));
  if (int8_cache) {
    // As run() below, on an int8 cache: each query head's row quantized as the cache's rows are.
    using B = c10::BFloat16;
    const B* qp = q.data_ptr<B>();
    B* op = out.data_ptr<B>();
    const uint8_t* kp = k_cache.data_ptr<uint8_t>();
    const uint8_t* vp = v_cache.data_ptr<uint8_t>();
    const int64_t* btp = bt.data_ptr<int64_t>();
    const int64_t head_elems = num_blocks * sluice::int8_block_bytes(block_size, head_dim);
    const AttendInt8Fn fast = attend_int8_for(group, head_dim);
    for_each_work(total, parts, num_kv_heads, tok_req, [&] {
      return [&, qi = std::vector<int8_t>(group * head_dim), qscale = std::vector<float>(group),
              acc = std::vector<float>(group * head_dim), scores = std::vector<float>(),
              vscales = std::vector<float>(), qcorr = std::vector<int32_t>(group),
              probs = std::vector<int16_t>()](int64_t work, int64_t t, int64_t h) mutable {
        const int64_t start = window > 0 && tok_len[t] > window ? tok_len[t] - window : 0;
        const int64_t len = tok_len[t] - start;
        scores.resize(group * len);
        const uint8_t* kh = kp + h * head_elems;
        const uint8_t* vh = vp + h * head_elems;
        const int64_t* blocks = btp + tok_req[t] * max_blocks;
        const int64_t row = (t * num_heads + h * group) * head_dim;
        for (int64_t g = 0; g < group; ++g) {
          int32_t sum = 0;
          qscale[g] = sluice::quantize_row_i8(qp + row + g * head_dim, head_dim, qi.data() + g * head_dim, &sum) * fscale;
          qcorr[g] = 128 * sum;
        }
        if (fast && start == 0) {
          const int64_t plen = (len + 15) / 16 * 16;
          probs.resize(group * plen);
          vscales.resize(plen + group * plen / 16);  // the V scales, then attend_int8's group scales
          Prefetching pf;
          pf.on = qsp[tok_req[t] + 1] - qsp[tok_req[t]] == 1;  // a decode
          const int64_t nw = work + parts;
          if (pf.on && nw < total && tok_req[nw / num_kv_heads] >= 0) {
            pf.k = kp + (nw % num_kv_heads) * head_elems;
            pf.blocks = btp + tok_req[nw / num_kv_heads] * max_blocks;
            pf.len = tok_len[nw / num_kv_heads];
          }
          fast(qi.data(), qscale.data(), qcorr.data(), kh, vh, blocks, len, block_size, scores.data(),
               vscales.data(), probs.data(), op + row, pf);
          return;
        }
        attend_one_int8(qi.data(), qscale.data(), qcorr.data(), kh, vh, blocks, len, block_size, group, head_dim, scores.data(),
                        acc.data(), start);
        for (int64_t i = 0; i < group * head_dim; ++i) op[row + i] = static_cast<B>(acc[i]);
      };
    });
    return;
  }
  auto run = [&](auto* qp, auto* kp, auto* vp, auto* op) {
    using T_ = std::remove_const_t<std::remove_pointer_t<decltype(qp)>>;
    const int64_t* btp = bt.data_ptr<int64_t>();
    const AttendFn<T_> fixed = attend_fixed_for<T_>(group, head_dim);
    const AttendBf16Fn fast_bf16 = std::is_same_v<T_, c10::BFloat16> ? attend_bf16_for(group, head_dim) : nullptr;
    for_each_work(total, parts, num_kv_heads, tok_req, [&] {
      return [&, qf = std::vector<float>(group * head_dim), acc = std::vector<float>(group * head_dim),
              scores = std::vector<float>(), probs = std::vector<uint16_t>()](int64_t work, int64_t t,
                                                                               int64_t h) mutable {
        const int64_t start = window > 0 && tok_len[t] > window ? tok_len[t] - window : 0;
        const int64_t len = tok_len[t] - start;
        scores.resize(group * len);
        const T_* kh = kp + h * num_blocks * block_size * head_dim;
        const T_* vh = vp + h * num_blocks * block_size * head_dim;
        const int64_t* blocks = btp + tok_req[t] * max_blocks;
        const int64_t row = (t * num_heads + h * group) * head_dim;  // the group's q and output rows
        if constexpr (std::is_same_v<T_, c10::BFloat16>) {
          if (fast_bf16 && start == 0) {
            probs.resize(group * (len + 1));
            Prefetching pf;
            pf.on = qsp[tok_req[t] + 1] - qsp[tok_req[t]] == 1;  // a decode
            const int64_t nw = work + parts;
            if (pf.on && nw < total && tok_req[nw / num_kv_heads] >= 0) {
              const int64_t nt = nw / num_kv_heads;
              pf.k = kp + (nw % num_kv_heads) * num_blocks * block_size * head_dim;
              pf.blocks = btp + tok_req[nt] * max_blocks;
              pf.len = tok_len[nt];
            }
            fast_bf16(qp + row, fscale, kh, vh, blocks, len, block_size, scores.data(), probs.data(), op + row, pf);
            return;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          const T_* src = qp + (t * num_heads + h * group + g) * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] = to_float(src[i]) * fscale;
        }
        if (fixed && start == 0) {
          fixed(qf.data(), kh, vh, blocks, len, block_size, scores.data(), acc.data());
        } else
        attend_one(qf.data(), kh, vh, blocks, len, block_size, group, head_dim, scores.data(), acc.data(), start);
        for (int64_t g = 0; g < group; ++g) {
          T_* dst = op + (t * num_heads + h * group + g) * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<T_>(acc[g * head_dim + i]);
        }
      };
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>());
  } else if (q.scalar_type() == at::kBFloat16) {
    run(q.data_ptr<c10::BFloat16>(), k_cache.data_ptr<c10::BFloat16>(), v_cache.data_ptr<c10::BFloat16>(),
        out.data_ptr<c10::BFloat16>());
  } else {
    TORCH_CHECK(false, "paged_attention_varlen supports float32 and bfloat16");
  }
}

// Decodes only: one query token per sequence, i.e. the varlen case with query_start = 0..B.
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale) {
  return paged_attention_varlen(q, k_cache, v_cache, block_tables,
                                at::arange(seq_lens.size(0) + 1, seq_lens.options().dtype(at::kLong)),
                                seq_lens, scale, 0);
}
