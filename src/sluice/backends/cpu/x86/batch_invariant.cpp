// Batch-invariant CPU kernels for deterministic mode.
//
// Every output element is reduced in an order fixed by the element alone: the number
// of rows in the batch, where a row sits in it and how the work is split over threads
// never change the arithmetic that produces it. Library kernels (oneDNN, torch's own
// reductions) do not promise that: their blocking, and so the order of a dot product's
// partial sums, depends on the matrix shape.
//
// - linear: y = x W^T (+ b). Columns are vectorised, 16 per register; each lane
//   accumulates its column over K from k = 0 upward, one pair of k (bf16) or one k
//   (fp32) per instruction, with no split of K and no horizontal sum. Rows are blocked
//   8 at a time to reuse each weight load, but a row's lanes never mix with another's,
//   so a row gives the same bits alone or among 2,048 others.
// - rms_norm, silu_and_mul: one row at a time, every element through the same vector
//   code (masked for the tail of a row, never a scalar path that rounds differently).
// - attention: see paged_attention.cpp; every token, prefill or decode, goes through
//   the same per-token routine there.
#include "aten.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "simd.h"
#include "kernels.h"

namespace sluice {

constexpr int kLanes = 16;
constexpr int kCols = 3;     // 16-column groups per register block (48 columns)
// AVX2 has 16 vector registers for AVX-512's 32 and each 16-lane sum takes two: there
// blocks are at most 4 rows, and a block of 4 runs its column groups one at a time
// (block_cols); fewer rows keep all three groups, whose independent sums hide the FMA
// latency that one group's chain of two FMAs per step would wait on.
#if defined(SLUICE_AVX2)
constexpr int kRows = 4;
constexpr int kMaxSums = 6;  // 16-lane float sums a block keeps in registers
#else
constexpr int kRows = 8;     // rows per register block (24 accumulators)
constexpr int kMaxSums = kRows * kCols;
#endif

inline __m512 bf16x16_to_f32_masked(const uint16_t* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Round to nearest even, as torch's float -> bfloat16 conversion does.
inline __m256i f32_to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }
// Elements j..j+15 of a row of n (float32 or bf16) as float32, zeros past n; and the
// store back, rounded to T (the row-wise kernels' and widen_bf16's access).
template <typename T>
inline __m512 load_row(const T* p, int64_t j, int64_t n) {
  const int64_t left = n - j;
  const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  if constexpr (std::is_same_v<T, float>) return _mm512_maskz_loadu_ps(m, p + j);
  else return bf16x16_to_f32_masked(reinterpret_cast<const uint16_t*>(p) + j, m);
}
template <typename T>
inline void store_row(T* p, int64_t j, int64_t n, __m512 v) {
  const int64_t left = n - j;
  const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  if constexpr (std::is_same_v<T, float>) _mm512_mask_storeu_ps(p + j, m, v);
  else _mm256_mask_storeu_epi16(reinterpret_cast<uint16_t*>(p) + j, m, f32_to_bf16x16(v));
}

// ---------------------------------------------------------------------------------
// Weight packing: [N/16][ceil(K/kPer)][16][kPer], 16 output columns side by side per K
// step. kPer = 2 for bf16 and int8 (the pair layout vdpbf16ps reads), 1 for float32. N is
// padded to a multiple of 16 (and K to a whole step) with zeros.
template <typename T, int kPer>
at::Tensor pack(const at::Tensor& w) {
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kLanes - 1) / kLanes, KS = (K + kPer - 1) / kPer;
  auto out = at::zeros({NB, KS, kLanes, kPer}, w.options());
  const T* src = reinterpret_cast<const T*>(w.data_ptr());
  T* dst = reinterpret_cast<T*>(out.data_ptr());
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      dst[(((n / kLanes) * KS + k / kPer) * kLanes + n % kLanes) * kPer + k % kPer] = src[n * K + k];
  return out;
}

at::Tensor pack_weight(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [N, K]");
  w = w.contiguous();
  if (w.scalar_type() == at::kBFloat16) return pack<uint16_t, 2>(w);
  TORCH_CHECK(w.scalar_type() == at::kFloat, "pack_weight supports float32 and bfloat16");
  return pack<float, 1>(w).squeeze(-1);
}

// Rows `ids` ([T] int64) of an [N, K] bf16 weight packed by pack_weight, as [T, K] bf16: the
// embedding read from a tied LM head's packed copy (backends/cpu/linear.py PackedRows),
// a pair of k (4 bytes) at a time. The same values as the table: the table is not kept.
at::Tensor packed_rows(at::Tensor ids, at::Tensor packed, int64_t N, int64_t K) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be [T] int64");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.size(2) == kLanes &&
                  packed.size(3) == 2 && packed.is_contiguous(),
              "packed must be a bf16 weight from bi_pack_weight");
  const int64_t NB = packed.size(0), KS = packed.size(1), T = ids.size(0);
  TORCH_CHECK(K > 0 && (K + 1) / 2 == KS && N > 0 && (N + kLanes - 1) / kLanes == NB,
              "N, K do not match the packed weight");
  ids = ids.contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(ip[t] >= 0 && ip[t] < N, "row out of range");
  auto out = at::empty({T, 2 * KS}, packed.options());
  const uint32_t* src = reinterpret_cast<const uint32_t*>(packed.data_ptr());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  sluice::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint32_t* row = src + (ip[t] / kLanes) * KS * kLanes + ip[t] % kLanes;
      for (int64_t ks = 0; ks < KS; ++ks) dst[t * KS + ks] = row[ks * kLanes];
    }
  });
  return K == 2 * KS ? out : out.narrow(1, 0, K).contiguous();
}

// int8 weights (weight-only quantization), in the bf16 pair layout.
at::Tensor pack_weight_int8(at::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar, "int8 weight must be [N, K] int8");
  return pack<int8_t, 2>(q.contiguous());
}

// Store one 16-column group of one row, in float32 or bfloat16, masked at the end of N;
// the per-column scale (int8 weights) and bias are applied to the finished sum.
inline void store_group(__m512 acc, const float* scale, const float* bias, int64_t n0, int64_t N, bool out_f32,
                        void* out_row) {
  const int64_t left = N - n0;
  const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  if (scale) acc = _mm512_mul_ps(acc, _mm512_maskz_loadu_ps(m, scale + n0));
  if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, bias + n0));
  if (out_f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out_row) + n0, m, acc);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out_row) + n0, m, f32_to_bf16x16(acc));
  }
}

// bf16 activations x int8 weights: each 32-byte group of weights (16 columns x a pair of
// k) is multiplied with the activations' bf16 pairs; the per-column scale multiplies the
// finished sum. Half the bytes of bf16 weights, which is what a decode step at small
// batch is bound by.
#if !defined(__AVX512BF16__)
// The builds without AVX-512 BF16 (AVX2, avx512_vnni) skip the bf16 round trip, which
// costs several instructions per vector there (vcvtneps2bf16 is BF16's): the 32 int8
// weights are widened to int16 pairs (one pair of k per column in each 32-bit lane, the
// layout of bf16 pairs), and each k's value goes to float32 directly. x's bf16 pair . the
// weights' pair, the odd k then the even one, with exact products: what vdpbf16ps
// computes on the widened bf16, bit for bit.
#define SLUICE_INT8_AS_INT16 1
inline __m512i int8x32_to_int16(const int8_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_cvtepi8_epi16(raw);
}
// The odd and the even k of each lane's int16 pair, as float32 (exact).
inline __m512 int16_odd_to_f32(__m512i w) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(w, 16)); }
inline __m512 int16_even_to_f32(__m512i w) { return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16)); }
inline __m512 int16_pairs_fma(__m512 acc, __m512i x, __m512i w) {
  const __m512 x_odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
  const __m512 x_even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  return _mm512_fmadd_ps(x_even, int16_even_to_f32(w), _mm512_fmadd_ps(x_odd, int16_odd_to_f32(w), acc));
}
#else
// With BF16: the weights widened to bf16 in registers (exact: |q| <= 127) and fed to the
// same vdpbf16ps as bf16 weights.
inline __m512i int8x32_to_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}
#endif

// The three weight formats as one interface for the block kernel: a K "step" is a pair
// of k for bf16 activations (one vdpbf16ps) and one k for float32 (one FMA).
template <typename WeightT>
struct PairWeights {  // bf16 activations; WeightT = uint16_t (bf16) or int8_t
  using Act = uint16_t;
  using Vec = __m512i;
  const WeightT* w;
  int64_t KP;  // pairs of k per 16-column group
  static int64_t steps(int64_t K) { return K / 2; }
  static constexpr bool kOddTail = true;
  const char* panel(int64_t nb) const { return reinterpret_cast<const char*>(w + nb * KP * kLanes * 2); }
  int64_t panel_bytes(int64_t groups) const { return groups * KP * kLanes * 2 * sizeof(WeightT); }
  Vec load_b(int64_t nb, int64_t s) const {
#if defined(SLUICE_INT8_AS_INT16)
    if constexpr (std::is_same_v<WeightT, int8_t>) return int8x32_to_int16(w + (nb * KP + s) * kLanes * 2);
#else
    if constexpr (std::is_same_v<WeightT, int8_t>) return int8x32_to_bf16(w + (nb * KP + s) * kLanes * 2);
#endif
    else return _mm512_loadu_si512(w + (nb * KP + s) * kLanes * 2);
  }
  static Vec bcast_a(const Act* row, int64_t s) {
    int32_t pair;
    std::memcpy(&pair, row + 2 * s, sizeof(pair));
    return _mm512_set1_epi32(pair);
  }
  static Vec bcast_last(const Act* row, int64_t K) {  // odd K: the last k, its partner zero
    return _mm512_set1_epi32(static_cast<int32_t>(row[K - 1]));
  }
  static __m512 fma(__m512 acc, Vec a, Vec b) {
#if defined(SLUICE_INT8_AS_INT16)
    if constexpr (std::is_same_v<WeightT, int8_t>) return int16_pairs_fma(acc, a, b);
#endif
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
  }
};

#if !defined(__AVX512BF16__) && !defined(SLUICE_AVX2)
// bf16 and int8 weights on the avx512_vnni build (AVX-512 without BF16), where vdpbf16ps
// is an and, a shift and two FMAs per operand (avx512/bf16_on_avx512.h) and the int8
// weights' int16 pairs split the same way: the activations are widened to float32 once per
// call (pair_gemm), so each row's k takes one broadcast, and only the
// weights are split in registers. In an 8-row x 3-group block that is 48 FMAs and 6 splits
// per pair of k for bf16 (12 for int8) instead of 48 and 22 (28): the 8 rows' pairs split
// too, on the same two vector ports. The same products in the same order as
// PairWeights (the odd k, then the even), so the same bits.
template <typename WeightT>  // uint16_t (bf16) or int8_t
struct WideXPairWeights {
  using Act = float;  // x widened: x[k] as float32, in k order
  struct Vec {
    __m512 odd, even;
  };
  using ActVec = const float*;  // a row's pair (x[2s], x[2s + 1]), broadcast where used
  const WeightT* w;
  int64_t KP;
  static int64_t steps(int64_t K) { return K / 2; }
  // An odd K is padded (widen_bf16): its last pair is x[K - 1] and a zero, with the
  // weights' zero, as the other formats' tail computes it.
  static constexpr bool kOddTail = false;
  const char* panel(int64_t nb) const { return reinterpret_cast<const char*>(w + nb * KP * kLanes * 2); }
  int64_t panel_bytes(int64_t groups) const { return groups * KP * kLanes * 2 * sizeof(WeightT); }
  Vec load_b(int64_t nb, int64_t s) const {
    if constexpr (std::is_same_v<WeightT, int8_t>) {
      const __m512i v = int8x32_to_int16(w + (nb * KP + s) * kLanes * 2);
      return {int16_odd_to_f32(v), int16_even_to_f32(v)};
    } else {
      // The odd halves by a zero-masking move: a mask register, where a constant for an
      // and would take the 33rd vector register of an 8 x 3 block.
      const __m512i raw = _mm512_loadu_si512(w + (nb * KP + s) * kLanes * 2);
      return {_mm512_castsi512_ps(_mm512_maskz_mov_epi16(static_cast<__mmask32>(0xAAAAAAAAu), raw)),
              _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16))};
    }
  }
  static ActVec bcast_a(const Act* row, int64_t s) { return row + 2 * s; }
  // One row: every group's odd product, then every group's even one (each sum still takes
  // its odd k first), so one broadcast is live at a time: 24 sums + 6 weight vectors + 1.
  template <int C>
  static void fma_row(__m512 (&acc)[C], ActVec a, const Vec (&b)[C]) {
    const __m512 odd = _mm512_set1_ps(a[1]);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(odd, b[c].odd, acc[c]);
    const __m512 even = _mm512_set1_ps(a[0]);
    for (int c = 0; c < C; ++c) acc[c] = _mm512_fmadd_ps(even, b[c].even, acc[c]);
  }
};

// x [M, K] bf16 as float32 (exact), each row padded with zeros to Kp (K rounded up to
// whole pairs), in a buffer of the calling thread's that lives until its next call.
inline const float* widen_bf16(const uint16_t* x, int64_t M, int64_t K, int64_t Kp) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < M * Kp) buf.resize(M * Kp);
  for (int64_t m = 0; m < M; ++m)  // Kp <= K + 1: every 16 lanes start inside the row
    for (int64_t j = 0; j < Kp; j += kLanes) store_row(buf.data() + m * Kp, j, Kp, load_row(x + m * K, j, K));
  return buf.data();
}
#endif

struct Float32Weights {
  using Act = float;
  using Vec = __m512;
  const float* w;
  int64_t K;
  static int64_t steps(int64_t K) { return K; }
  static constexpr bool kOddTail = false;
  const char* panel(int64_t nb) const { return reinterpret_cast<const char*>(w + nb * K * kLanes); }
  int64_t panel_bytes(int64_t groups) const { return groups * K * kLanes * sizeof(float); }
  Vec load_b(int64_t nb, int64_t s) const { return _mm512_loadu_ps(w + (nb * K + s) * kLanes); }
  static Vec bcast_a(const Act* row, int64_t s) { return _mm512_set1_ps(row[s]); }
  static Vec bcast_last(const Act*, int64_t) { return _mm512_setzero_ps(); }
  static __m512 fma(__m512 acc, Vec a, Vec b) { return _mm512_fmadd_ps(a, b, acc); }
};


// One row's sums += its activations (a) x C groups of weights (b): the format's own
// order where it has one (WideXPairWeights), else group by group.
template <typename W, int C, typename A>
inline void fma_row(__m512 (&acc)[C], const A& a, const typename W::Vec (&b)[C]) {
  if constexpr (requires { W::template fma_row<C>(acc, a, b); }) W::template fma_row<C>(acc, a, b);
  else for (int c = 0; c < C; ++c) acc[c] = W::fma(acc[c], a, b[c]);
}

// R rows x C groups of 16 columns; each lane's sum runs over K from 0 upward.
template <int R, int C, typename W>
void block(const W& w, const typename W::Act* X, int64_t K, int64_t nb0, const float* scale, const float* bias,
           int64_t N, bool out_f32, void* out, int64_t m0, Prefetch pf) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t steps = W::steps(K);
  for (int64_t s = 0; s < steps; ++s) {
    pf.step();
    typename W::Vec b[C];
    for (int c = 0; c < C; ++c) b[c] = w.load_b(nb0 + c, s);
    for (int r = 0; r < R; ++r) fma_row<W>(acc[r], W::bcast_a(X + (m0 + r) * K, s), b);
  }
  if constexpr (W::kOddTail) {
    if (K % 2) {
      typename W::Vec b[C];
      for (int c = 0; c < C; ++c) b[c] = w.load_b(nb0 + c, steps);
      for (int r = 0; r < R; ++r) fma_row<W>(acc[r], W::bcast_last(X + (m0 + r) * K, K), b);
    }
  }
  const size_t esz = out_f32 ? 4 : 2;
  for (int r = 0; r < R; ++r) {
    char* row = static_cast<char*>(out) + (m0 + r) * N * esz;
    for (int c = 0; c < C; ++c) store_group(acc[r][c], scale, bias, (nb0 + c) * kLanes, N, out_f32, row);
  }
}

template <int R, typename W>
void block_cols(int C, const W& w, const typename W::Act* X, int64_t K, int64_t nb0, const float* scale,
                const float* bias, int64_t N, bool out_f32, void* out, int64_t m0, Prefetch pf) {
  if constexpr (R * kCols > kMaxSums) {  // one group at a time (the same sums, in the same order)
    for (int c = 0; c < C; ++c) block<R, 1>(w, X, K, nb0 + c, scale, bias, N, out_f32, out, m0, pf);
    return;
  }
  switch (C) {
    case 1: return block<R, 1>(w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf);
    case 2: return block<R, 2>(w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf);
    default: return block<R, kCols>(w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf);
  }
}

// out[M, N] = X[M, K] W^T. Work unit: kCols groups of 16 columns over all rows, so each
// weight panel is loaded from memory once per unit and reused by every row block; rows go
// kRows at a time, the last few in blocks of 4, 2 and 1. Threads split units, never K, and
// no blocking choice touches the order of any lane's sum.
template <typename W>
void gemm(const W& w, const typename W::Act* X, int64_t M, int64_t K, int64_t N, const float* scale,
          const float* bias, bool out_f32, void* out) {
  const int64_t NB = (N + kLanes - 1) / kLanes, units = (NB + kCols - 1) / kCols;
  // Row blocks (start, rows) of every unit.
  std::vector<std::pair<int64_t, int>> rows;
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const int r = left >= kRows ? kRows : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    rows.emplace_back(m0, r);
    m0 += r;
  }
  const int64_t passes = static_cast<int64_t>(rows.size()), steps = std::max<int64_t>(1, W::steps(K));
  parallel_units(units, M > kBalanceRows, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t nb0 = u * kCols;
      const int C = static_cast<int>(std::min<int64_t>(kCols, NB - nb0));
      // The next unit's panel (if this thread runs it), a 1/passes share of it per pass.
      const char* next = u + 1 < end && passes <= kPrefetchMaxPasses ? w.panel(nb0 + kCols) : nullptr;
      const int64_t next_lines = next ? (w.panel_bytes(std::min<int64_t>(kCols, NB - nb0 - kCols)) + 63) / 64 : 0;
      for (int64_t p = 0; p < passes; ++p) {
        const Prefetch pf = Prefetch::share(next, next_lines, p, passes, steps);
        const auto [m0, r] = rows[p];
        switch (r) {
          case 1: block_cols<1>(C, w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf); break;
          case 2: block_cols<2>(C, w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf); break;
          case 4: block_cols<4>(C, w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf); break;
          default: block_cols<kRows>(C, w, X, K, nb0, scale, bias, N, out_f32, out, m0, pf); break;
        }
      }
    }
  });
}

// out = x W^T for bf16 x and weights in the pair layout (bf16 or int8): PairWeights, or
// WideXPairWeights with x widened where the build has no BF16 instructions on AVX-512.
template <typename WeightT>
void pair_gemm(const WeightT* w, const uint16_t* x, int64_t M, int64_t K, int64_t N, const float* scale,
               const float* bias, bool out_f32, void* out) {
  const int64_t KP = (K + 1) / 2;
#if !defined(__AVX512BF16__) && !defined(SLUICE_AVX2)
  gemm(WideXPairWeights<WeightT>{w, KP}, widen_bf16(x, M, K, 2 * KP), M, 2 * KP, N, scale, bias, out_f32, out);
#else
  gemm(PairWeights<WeightT>{w, KP}, x, M, K, N, scale, bias, out_f32, out);
#endif
}

at::Tensor float_or_empty(const c10::optional<at::Tensor>& t) {
  return t.has_value() && t->defined() ? t->to(at::kFloat).contiguous() : at::Tensor();
}

// x: [M, K]; packed from pack_weight; N: output features. Returns [M, N] in x's dtype,
// or float32 when out_float32 (the LM head: logits stay in float32 for the sampler).
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                  bool out_float32) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  x = x.contiguous();
  const bool out_f32 = out_float32 || x.scalar_type() != at::kBFloat16;
  auto out = at::empty({x.size(0), N}, x.options().dtype(out_f32 ? at::kFloat : x.scalar_type()));
  linear_into(x, packed, N, bias, out);
  return out;
}

void linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be [M, K], contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == at::kFloat, "linear supports float32 and bfloat16");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
  TORCH_CHECK(packed.size(0) == (N + kLanes - 1) / kLanes && packed.size(1) == (bf16 ? (K + 1) / 2 : K),
              "packed weight does not match [N, K]");
  const bool out_f32 = out.scalar_type() == at::kFloat;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
              (out_f32 || (bf16 && out.scalar_type() == at::kBFloat16)), "out must be [M, N] float32 (or bfloat16 for bfloat16 x)");
  const auto bias_f = float_or_empty(bias);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (M == 0) return;
  if (bf16) {
    pair_gemm(reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>()),
              reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, N, nullptr, bp, out_f32,
              out.data_ptr());
  } else {
    const Float32Weights w{packed.data_ptr<float>(), K};
    gemm(w, x.data_ptr<float>(), M, K, N, nullptr, bp, true, out.data_ptr());
  }
}

// x: [M, K] bf16; packed from pack_weight_int8; scale: [N] per output column.
at::Tensor linear_int8(at::Tensor x, at::Tensor packed, at::Tensor scale, int64_t N,
                       c10::optional<at::Tensor> bias, bool out_float32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.scalar_type() == at::kChar, "packed int8 weight expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.size(0) == (N + kLanes - 1) / kLanes && packed.size(1) == (K + 1) / 2,
              "packed weight does not match [N, K]");
  auto scale_f = scale.to(at::kFloat).contiguous();
  TORCH_CHECK(scale_f.numel() == N, "one scale per output column");
  const auto bias_f = float_or_empty(bias);
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto out = at::empty({M, N}, x.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  pair_gemm(packed.data_ptr<int8_t>(), reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M, K, N,
            scale_f.data_ptr<float>(), bp, out_float32, out.data_ptr());
  return out;
}

// ---------------------------------------------------------------------------------
// Row-wise elementwise helpers (load_row and store_row at the top): 16 lanes at a time, the
// tail masked, so the arithmetic for column j is the same instruction sequence whatever the
// row count.
// Rounds a float32 vector to T and back (the rounding torch applies between two ops in T).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else {
    __m256i h = f32_to_bf16x16(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// RMSNorm over the last dim: y = w * T(x * rsqrt(mean(x^2) + eps)), float32 inside; with
// float32 weights under bf16 rows (Gemma's 1 + w, kept in float32 as its own code keeps
// the product), y = T(x * rsqrt(mean(x^2) + eps) * w), rounded once. With `residual`, x is
// first replaced by T(x + residual), written to `sum` (the residual stream's next value):
// torch's `x + residual` then the norm, in one pass.
template <typename T, typename W>
inline void rms_norm_row(const T* xr, const T* residual, T* sum, const W* w, T* y, int64_t n, float eps) {
  if (residual) {
    for (int64_t j = 0; j < n; j += kLanes)
      store_row(sum, j, n, _mm512_add_ps(load_row(xr, j, n), load_row(residual, j, n)));
    xr = sum;
  }
  __m512 ss = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += kLanes) {
    const __m512 v = load_row(xr, j, n);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t j = 0; j < n; j += kLanes) {
    const __m512 normed = _mm512_mul_ps(load_row(xr, j, n), iv);
    if constexpr (std::is_same_v<W, float>)  // (for float32 rows the same product either way)
      store_row(y, j, n, _mm512_mul_ps(normed, load_row(w, j, n)));
    else
      store_row(y, j, n, _mm512_mul_ps(load_row(w, j, n), round_to<T>(normed)));
  }
}

template <typename T, typename W>
void rms_norm_impl(const T* x, const T* residual, T* sum, const W* w, T* y, int64_t rows, int64_t n, float eps) {
  sluice::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      rms_norm_row<T, W>(x + r * n, residual ? residual + r * n : nullptr, sum ? sum + r * n : nullptr, w,
                         y + r * n, n, eps);
  });
}

void rms_norm_dispatch(const at::Tensor& x, const at::Tensor* residual, at::Tensor* sum,
                       const at::Tensor& weight, at::Tensor& y, double eps) {
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(weight.numel() == n, "weight size != last dim");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight's dtype is the input's, or float32");
  if (x.scalar_type() == at::kFloat) {
    rms_norm_impl<float, float>(x.data_ptr<float>(), residual ? residual->data_ptr<float>() : nullptr,
                                sum ? sum->data_ptr<float>() : nullptr, weight.data_ptr<float>(), y.data_ptr<float>(),
                                rows, n, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "rms_norm supports float32 and bfloat16");
    using B = at::BFloat16;
    if (weight.scalar_type() == at::kFloat)
      rms_norm_impl<B, float>(x.data_ptr<B>(), residual ? residual->data_ptr<B>() : nullptr,
                              sum ? sum->data_ptr<B>() : nullptr, weight.data_ptr<float>(), y.data_ptr<B>(), rows, n,
                              eps);
    else
      rms_norm_impl<B, B>(x.data_ptr<B>(), residual ? residual->data_ptr<B>() : nullptr,
                          sum ? sum->data_ptr<B>() : nullptr, weight.data_ptr<B>(), y.data_ptr<B>(), rows, n, eps);
  }
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  x = x.contiguous();
  auto y = at::empty_like(x);
  rms_norm_dispatch(x, nullptr, nullptr, weight.contiguous(), y, eps);
  return y;
}

// (rms_norm(x + residual), x + residual).
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                double eps) {
  x = x.contiguous();
  residual = residual.contiguous();
  auto y = at::empty_like(x);
  auto sum = at::empty_like(x);
  add_rms_norm_into(x, residual, weight.contiguous(), eps, y, sum);
  return {y, sum};
}

// The same into y and sum (sum may be residual itself: each element is read before it is
// written).
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& y, at::Tensor& sum) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() && y.is_contiguous() &&
              sum.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "x and residual differ");
  TORCH_CHECK(y.sizes() == x.sizes() && sum.sizes() == x.sizes() && y.scalar_type() == x.scalar_type() &&
              sum.scalar_type() == x.scalar_type(), "outputs must match x");
  rms_norm_dispatch(x, &residual, &sum, weight, y, eps);
}

// SwiGLU's elementwise half: gate_up [rows, 2I] -> T(T(silu(gate)) * up) [rows, I].
template <typename T>
inline void silu_and_mul_row(const T* g, T* y, int64_t inter) {
  const T* u = g + inter;
  for (int64_t j = 0; j < inter; j += kLanes) {
    const __m512 gv = load_row(g, j, inter);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
    const __m512 s = round_to<T>(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
    store_row(y, j, inter, _mm512_mul_ps(s, load_row(u, j, inter)));
  }
}

template <typename T>
void silu_and_mul_impl(const T* gu, T* y, int64_t rows, int64_t inter) {
  sluice::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_and_mul_row<T>(gu + r * 2 * inter, y + r * inter, inter);
  });
}

at::Tensor silu_and_mul(at::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "last dim must be 2 * intermediate");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = two_i / 2;
  auto y = at::empty(sizes, gate_up.options());
  silu_and_mul_into(gate_up, y);
  return y;
}

void silu_and_mul_into(const at::Tensor& gate_up, at::Tensor& y) {
  const int64_t two_i = gate_up.size(-1), rows = two_i ? gate_up.numel() / two_i : 0;
  TORCH_CHECK(two_i % 2 == 0, "last dim must be 2 * intermediate");
  TORCH_CHECK(gate_up.is_contiguous() && y.is_contiguous() && y.scalar_type() == gate_up.scalar_type() &&
              y.numel() == rows * (two_i / 2), "gate_up and y contiguous, y [rows, intermediate] of its dtype");
  if (gate_up.scalar_type() == at::kFloat) {
    silu_and_mul_impl<float>(gate_up.data_ptr<float>(), y.data_ptr<float>(), rows, two_i / 2);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16, "silu_and_mul supports float32 and bfloat16");
    silu_and_mul_impl<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, two_i / 2);
  }
}

// The fused producers of w8a8 activations: each row is made in a small buffer by
// make(r, buffer) and quantized at once, instead of written out in bf16 and read back by
// linear_w8a8.
template <typename F>
void quantize_as_made(W8A8Rows& out, int64_t rows, int64_t n, int64_t grain, const F& make) {
  TORCH_CHECK(out.q.size(0) == rows && out.K == n, "quantized rows made for another shape");
  sluice::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> y(n);
    for (int64_t r = begin; r < end; ++r) {
      make(r, y.data());
      w8a8_quantize_row(reinterpret_cast<const uint16_t*>(y.data()), out, r);
    }
  });
}

std::tuple<W8A8Rows, at::Tensor> add_rms_norm_w8a8(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                   double eps) {
  x = x.contiguous();
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [rows, n] bfloat16");
  auto sum = at::empty_like(x);
  W8A8Rows out = w8a8_rows(x.size(0), x.size(1), x.options());
  add_rms_norm_w8a8_into(x, residual.contiguous(), weight.contiguous(), eps, out, sum);
  return {out, sum};
}

// The same into out and sum (sum may be residual itself: each element is read before it
// is written).
void add_rms_norm_w8a8_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                            W8A8Rows& out, at::Tensor& sum) {
  using B = at::BFloat16;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "x must be [rows, n] bfloat16");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous() && sum.is_contiguous(),
              "contiguous tensors expected");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(), "x and residual differ");
  TORCH_CHECK(sum.sizes() == x.sizes() && sum.scalar_type() == x.scalar_type(), "sum must match x");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.scalar_type() == x.scalar_type(), "weight does not match x");
  const B *xp = x.data_ptr<B>(), *rp = residual.data_ptr<B>(), *wp = weight.data_ptr<B>();
  B* sp = sum.data_ptr<B>();
  quantize_as_made(out, rows, n, 16, [&](int64_t r, B* y) {
    rms_norm_row<B>(xp + r * n, rp + r * n, sp + r * n, wp, y, n, static_cast<float>(eps));
  });
}

W8A8Rows silu_and_mul_w8a8(at::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16, "gate_up must be [rows, 2I] bfloat16");
  W8A8Rows out = w8a8_rows(gate_up.size(0), gate_up.size(1) / 2, gate_up.options());
  silu_and_mul_w8a8_into(gate_up, out);
  return out;
}

void silu_and_mul_w8a8_into(const at::Tensor& gate_up, W8A8Rows& out) {
  using B = at::BFloat16;
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == at::kBFloat16 && gate_up.is_contiguous(),
              "gate_up must be [rows, 2I] bfloat16, contiguous");
  const int64_t rows = gate_up.size(0), two_i = gate_up.size(1), inter = two_i / 2;
  TORCH_CHECK(two_i % 2 == 0, "last dim must be 2 * intermediate");
  const B* gp = gate_up.data_ptr<B>();
  quantize_as_made(out, rows, inter, 8, [&](int64_t r, B* y) { silu_and_mul_row<B>(gp + r * two_i, y, inter); });
}

// RoPE (rotate-half form) on q and k of a fused QKV row, K and V written into the paged
// cache at each token's slot, q returned as [T, Hq, D]: some twenty small torch ops per
// layer in one pass. Elementwise, so batch-invariant; the rounding replicates torch's
// q * cos + rotate_half(q) * sin in T op by op (each product and the sum rounded to T).
template <typename T>
inline void rotate_row(const T* x, const T* c, const T* s, T* out, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t j = 0; j < half; j += kLanes) {
    const __m512 x1 = load_row(x, j, half), x2 = load_row(x + half, j, half);
    const __m512 c1 = load_row(c, j, half), c2 = load_row(c + half, j, half);
    const __m512 s1 = load_row(s, j, half), s2 = load_row(s + half, j, half);
    const __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
    store_row(out, j, half, _mm512_add_ps(round_to<T>(_mm512_mul_ps(x1, c1)), round_to<T>(_mm512_mul_ps(neg_x2, s1))));
    store_row(out + half, j, half, _mm512_add_ps(round_to<T>(_mm512_mul_ps(x2, c2)), round_to<T>(_mm512_mul_ps(x1, s2))));
  }
}

template <typename T>
void rope_write_kv_impl(const T* qkv, const T* cos, const T* sin, T* q_out, T* kc, T* vc, const int64_t* slots,
                        int64_t tokens, int64_t hq, int64_t hkv, int64_t D, int64_t cache_rows) {
  sluice::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * (hq + 2 * hkv) * D;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t h = 0; h < hq; ++h) rotate_row(row + h * D, c, s, q_out + (t * hq + h) * D, D);
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < hkv; ++h) {
        rotate_row(row + (hq + h) * D, c, s, kc + (h * cache_rows + slot) * D, D);
        std::memcpy(vc + (h * cache_rows + slot) * D, row + (hq + hkv + h) * D, D * sizeof(T));
      }
    }
  });
}

// rope_write_kv_impl for an int8 cache: the rotated K row (rounded to bf16 as above) and the
// V row each quantized into their block (simd.h's layout).
void rope_write_kv_int8(const at::BFloat16* qkv, const at::BFloat16* cos, const at::BFloat16* sin,
                        at::BFloat16* q_out, uint8_t* kc, uint8_t* vc, const int64_t* slots, int64_t tokens,
                        int64_t hq, int64_t hkv, int64_t D, int64_t num_blocks, int64_t bs) {
  const int64_t bb = int8_block_bytes(bs, D);
  sluice::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> k(D);
    for (int64_t t = begin; t < end; ++t) {
      const at::BFloat16* row = qkv + t * (hq + 2 * hkv) * D;
      const at::BFloat16* c = cos + t * D;
      const at::BFloat16* s = sin + t * D;
      for (int64_t h = 0; h < hq; ++h) rotate_row(row + h * D, c, s, q_out + (t * hq + h) * D, D);
      const int64_t block = slots[t] / bs, off = slots[t] % bs;
      for (int64_t h = 0; h < hkv; ++h) {
        rotate_row(row + (hq + h) * D, c, s, k.data(), D);
        write_int8_k(k.data(), D, kc + (h * num_blocks + block) * bb, off, bs);
        write_int8_v(row + (hq + hkv + h) * D, D, vc + (h * num_blocks + block) * bb, off, bs);
      }
    }
  });
}

at::Tensor rope_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                         at::Tensor v_cache, at::Tensor slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "qkv [T, (Hq + 2 Hkv) D], caches [Hkv, blocks, block, D] contiguous");
  qkv = qkv.contiguous();
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  const int64_t T = qkv.size(0), D = k_cache.size(3) - (int8_cache ? kInt8RowExtra : 0);
  auto q = at::empty({T, num_heads, D}, qkv.options());
  rope_write_kv_into(qkv, cos.reshape({T, D}).contiguous(), sin.reshape({T, D}).contiguous(), k_cache, v_cache,
                     slot_mapping.to(at::kLong).contiguous(), num_heads, num_kv_heads, q);
  return q;
}

// The same with cos and sin [T, D] and int64 slots, contiguous, q written into q_out
// ([T, num_heads, D]).
void rope_write_kv_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads,
                        at::Tensor& q) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && k_cache.dim() == 4 && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "qkv [T, (Hq + 2 Hkv) D] contiguous, caches [Hkv, blocks, block, D] contiguous");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  const int64_t T = qkv.size(0), D = k_cache.size(3) - (int8_cache ? kInt8RowExtra : 0);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width");
  TORCH_CHECK(k_cache.size(0) == num_kv_heads, "cache kv heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D && sin.numel() == T * D,
              "cos and sin [T, D] contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "int64 slots");
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  TORCH_CHECK(q.is_contiguous() && q.numel() == T * num_heads * D && q.scalar_type() == qkv.scalar_type(),
              "q_out [T, heads, D] of qkv's dtype");
  TORCH_CHECK(!int8_cache || (D <= 512 && D % 4 == 0 && k_cache.size(2) % 16 == 0),
              "an int8 cache takes head_dim a multiple of 4 up to 512, blocks a multiple of 16 tokens");
  TORCH_CHECK((int8_cache ? qkv.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kByte
                          : qkv.scalar_type() == k_cache.scalar_type()) && cos.scalar_type() == qkv.scalar_type(),
              "dtypes differ (an int8 cache takes bf16 activations)");
  const int64_t cache_rows = k_cache.size(1) * k_cache.size(2);
  if (int8_cache) {
    using B = at::BFloat16;
    rope_write_kv_int8(qkv.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), q.data_ptr<B>(),
                       k_cache.data_ptr<uint8_t>(), v_cache.data_ptr<uint8_t>(), slots.data_ptr<int64_t>(), T,
                       num_heads, num_kv_heads, D, k_cache.size(1), k_cache.size(2));
  } else if (qkv.scalar_type() == at::kFloat) {
    rope_write_kv_impl<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
                              k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), T,
                              num_heads, num_kv_heads, D, cache_rows);
  } else {
    TORCH_CHECK(qkv.scalar_type() == at::kBFloat16, "rope_write_kv supports float32 and bfloat16");
    using B = at::BFloat16;
    rope_write_kv_impl<B>(qkv.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), q.data_ptr<B>(),
                          k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), slots.data_ptr<int64_t>(), T, num_heads,
                          num_kv_heads, D, cache_rows);
  }
}

}  // namespace sluice
