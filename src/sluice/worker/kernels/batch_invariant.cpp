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
//   4 at a time to reuse each weight load, but a row's lanes never mix with another's,
//   so a row gives the same bits alone or among 2,048 others.
// - rms_norm, silu_and_mul: one row at a time, every element through the same vector
//   code (masked for the tail of a row, never a scalar path that rounds differently).
// - attention: see paged_attention.cpp; every token, prefill or decode, goes through
//   the same per-token routine there.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// Without AVX-512 BF16 nothing is registered and deterministic mode reports that it
// is unavailable on this CPU.
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kLanes = 16;
constexpr int kRows = 4;     // rows per register block
constexpr int kCols = 4;     // 16-column groups per register block (64 columns)

inline __m512 bf16x16_to_f32(const uint16_t* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 bf16x16_to_f32_masked(const uint16_t* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// Round to nearest even, as torch's float -> bfloat16 conversion does.
inline __m256i f32_to_bf16x16(__m512 v) { return (__m256i)_mm512_cvtneps_pbh(v); }

// ---------------------------------------------------------------------------------
// Weight packing. bf16: [N/16][ceil(K/2)][16][2], the VNNI pair layout vdpbf16ps reads.
// fp32: [N/16][K][16]. N is padded to a multiple of 16 (and K to even) with zeros.
torch::Tensor pack_weight(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "weight must be [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), NB = (N + kLanes - 1) / kLanes;
  if (w.scalar_type() == torch::kBFloat16) {
    const int64_t KP = (K + 1) / 2;
    auto out = torch::zeros({NB, KP, kLanes, 2}, w.options());
    const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    uint16_t* dst = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[(((n / kLanes) * KP + k / 2) * kLanes + n % kLanes) * 2 + k % 2] = src[n * K + k];
    return out;
  }
  TORCH_CHECK(w.scalar_type() == torch::kFloat32, "pack_weight supports float32 and bfloat16");
  auto out = torch::zeros({NB, K, kLanes}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) dst[((n / kLanes) * K + k) * kLanes + n % kLanes] = src[n * K + k];
  return out;
}

// int8 weights (weight-only quantization) in the bf16 pair layout: [N/16][ceil(K/2)][16][2].
torch::Tensor pack_weight_int8(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8, "int8 weight must be [N, K] int8");
  q = q.contiguous();
  const int64_t N = q.size(0), K = q.size(1), NB = (N + kLanes - 1) / kLanes, KP = (K + 1) / 2;
  auto out = torch::zeros({NB, KP, kLanes, 2}, q.options());
  const int8_t* src = q.data_ptr<int8_t>();
  int8_t* dst = out.data_ptr<int8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      dst[(((n / kLanes) * KP + k / 2) * kLanes + n % kLanes) * 2 + k % 2] = src[n * K + k];
  return out;
}

// Store one 16-column group of one row, in float32 or bfloat16, masked at the end of N.
inline void store_group(__m512 acc, const float* bias, int64_t n0, int64_t N, bool out_f32, void* out_row) {
  const int64_t left = N - n0;
  const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  if (bias) acc = _mm512_add_ps(acc, _mm512_maskz_loadu_ps(m, bias + n0));
  if (out_f32) {
    _mm512_mask_storeu_ps(static_cast<float*>(out_row) + n0, m, acc);
  } else {
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out_row) + n0, m, f32_to_bf16x16(acc));
  }
}

// R rows x C groups of 16 columns, bf16 inputs, K reduced from 0 upward in pairs.
template <int R, int C>
void block_bf16(const uint16_t* A, int64_t K, const uint16_t* B, int64_t KP, int64_t nb0,
                const float* bias, int64_t N, bool out_f32, void* out, int64_t m0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  const uint16_t* Bc[C];
  for (int c = 0; c < C; ++c) Bc[c] = B + (nb0 + c) * KP * kLanes * 2;
  for (int64_t kp = 0; kp < full; ++kp) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(Bc[c] + kp * kLanes * 2);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + (m0 + r) * K + 2 * kp, sizeof(pair));
      const __m512i a = _mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
    }
  }
  if (K % 2) {  // last k alone: its pair partner is a zero in both operands
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_si512(Bc[c] + full * kLanes * 2);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(A[(m0 + r) * K + K - 1]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
    }
  }
  const size_t esz = out_f32 ? 4 : 2;
  for (int r = 0; r < R; ++r) {
    char* row = static_cast<char*>(out) + (m0 + r) * N * esz;
    for (int c = 0; c < C; ++c) store_group(acc[r][c], bias, (nb0 + c) * kLanes, N, out_f32, row);
  }
}

// bf16 activations x int8 weights: each 32-byte group of weights (16 columns x a pair of
// k) is widened to bf16 in registers (exact: |q| <= 127) and fed to the same vdpbf16ps
// as the bf16 path; the per-column scale multiplies the finished sum. Reads half the
// bytes of bf16 weights, which is what a decode step at small batch is bound by.
inline __m512i int8x32_to_bf16(const int8_t* p) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
  return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

template <int R, int C>
void block_i8(const uint16_t* A, int64_t K, const int8_t* B, int64_t KP, int64_t nb0, const float* scale,
              const float* bias, int64_t N, bool out_f32, void* out, int64_t m0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  const int8_t* Bc[C];
  for (int c = 0; c < C; ++c) Bc[c] = B + (nb0 + c) * KP * kLanes * 2;
  for (int64_t kp = 0; kp < full; ++kp) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = int8x32_to_bf16(Bc[c] + kp * kLanes * 2);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + (m0 + r) * K + 2 * kp, sizeof(pair));
      const __m512i a = _mm512_set1_epi32(pair);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
    }
  }
  if (K % 2) {
    __m512i b[C];
    for (int c = 0; c < C; ++c) b[c] = int8x32_to_bf16(Bc[c] + full * kLanes * 2);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(A[(m0 + r) * K + K - 1]));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)a, (__m512bh)b[c]);
    }
  }
  const size_t esz = out_f32 ? 4 : 2;
  for (int r = 0; r < R; ++r) {
    char* row = static_cast<char*>(out) + (m0 + r) * N * esz;
    for (int c = 0; c < C; ++c) {
      const int64_t n0 = (nb0 + c) * kLanes, left = N - n0;
      const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      store_group(_mm512_mul_ps(acc[r][c], _mm512_maskz_loadu_ps(m, scale + n0)), bias, n0, N, out_f32, row);
    }
  }
}

template <int R>
void dispatch_cols_i8(int C, const uint16_t* A, int64_t K, const int8_t* B, int64_t KP, int64_t nb0,
                      const float* scale, const float* bias, int64_t N, bool out_f32, void* out, int64_t m0) {
  switch (C) {
    case 1: return block_i8<R, 1>(A, K, B, KP, nb0, scale, bias, N, out_f32, out, m0);
    case 2: return block_i8<R, 2>(A, K, B, KP, nb0, scale, bias, N, out_f32, out, m0);
    case 3: return block_i8<R, 3>(A, K, B, KP, nb0, scale, bias, N, out_f32, out, m0);
    default: return block_i8<R, 4>(A, K, B, KP, nb0, scale, bias, N, out_f32, out, m0);
  }
}

// The same for float32 inputs: one k per fused multiply-add.
template <int R, int C>
void block_f32(const float* A, int64_t K, const float* B, int64_t nb0, const float* bias, int64_t N,
               bool out_f32, void* out, int64_t m0) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* Bc[C];
  for (int c = 0; c < C; ++c) Bc[c] = B + (nb0 + c) * K * kLanes;
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[C];
    for (int c = 0; c < C; ++c) b[c] = _mm512_loadu_ps(Bc[c] + k * kLanes);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(A[(m0 + r) * K + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* row = static_cast<float*>(out) + (m0 + r) * N;
    for (int c = 0; c < C; ++c) store_group(acc[r][c], bias, (nb0 + c) * kLanes, N, true, row);
  }
}

template <int R>
void dispatch_cols_bf16(int C, const uint16_t* A, int64_t K, const uint16_t* B, int64_t KP, int64_t nb0,
                        const float* bias, int64_t N, bool out_f32, void* out, int64_t m0) {
  switch (C) {
    case 1: return block_bf16<R, 1>(A, K, B, KP, nb0, bias, N, out_f32, out, m0);
    case 2: return block_bf16<R, 2>(A, K, B, KP, nb0, bias, N, out_f32, out, m0);
    case 3: return block_bf16<R, 3>(A, K, B, KP, nb0, bias, N, out_f32, out, m0);
    default: return block_bf16<R, 4>(A, K, B, KP, nb0, bias, N, out_f32, out, m0);
  }
}
template <int R>
void dispatch_cols_f32(int C, const float* A, int64_t K, const float* B, int64_t nb0, const float* bias,
                       int64_t N, void* out, int64_t m0) {
  switch (C) {
    case 1: return block_f32<R, 1>(A, K, B, nb0, bias, N, true, out, m0);
    case 2: return block_f32<R, 2>(A, K, B, nb0, bias, N, true, out, m0);
    case 3: return block_f32<R, 3>(A, K, B, nb0, bias, N, true, out, m0);
    default: return block_f32<R, 4>(A, K, B, nb0, bias, N, true, out, m0);
  }
}

// x: [M, K]; packed from pack_weight; N: output features. Returns [M, N] in x's dtype,
// or float32 when out_float32 (the LM head: logits stay in float32 for the sampler).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     bool out_float32) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = (N + kLanes - 1) / kLanes;
  TORCH_CHECK(packed.size(0) == NB, "packed weight does not match N");
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat32, "linear supports float32 and bfloat16");
  TORCH_CHECK(packed.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
  const bool out_f32 = out_float32 || !bf16;
  auto out = torch::empty({M, N}, x.options().dtype(out_f32 ? torch::kFloat32 : x.scalar_type()));
  if (M == 0) return out;
  const int64_t KP = (K + 1) / 2;
  TORCH_CHECK(bf16 ? packed.size(1) == KP : packed.size(1) == K, "packed weight does not match K");
  void* op = out.data_ptr();
  // Work unit: 64 columns over all rows, so each weight panel is loaded once per unit
  // and reused by every row block. The split over threads never touches a reduction.
  const int64_t units = (NB + kCols - 1) / kCols;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t nb0 = u * kCols;
      const int C = static_cast<int>(std::min<int64_t>(kCols, NB - nb0));
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        const int R = static_cast<int>(std::min<int64_t>(kRows, M - m0));
        if (bf16) {
          const uint16_t* A = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
          const uint16_t* B = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
          switch (R) {
            case 1: dispatch_cols_bf16<1>(C, A, K, B, KP, nb0, bp, N, out_f32, op, m0); break;
            case 2: dispatch_cols_bf16<2>(C, A, K, B, KP, nb0, bp, N, out_f32, op, m0); break;
            case 3: dispatch_cols_bf16<3>(C, A, K, B, KP, nb0, bp, N, out_f32, op, m0); break;
            default: dispatch_cols_bf16<4>(C, A, K, B, KP, nb0, bp, N, out_f32, op, m0); break;
          }
        } else {
          const float* A = x.data_ptr<float>();
          const float* B = packed.data_ptr<float>();
          switch (R) {
            case 1: dispatch_cols_f32<1>(C, A, K, B, nb0, bp, N, op, m0); break;
            case 2: dispatch_cols_f32<2>(C, A, K, B, nb0, bp, N, op, m0); break;
            case 3: dispatch_cols_f32<3>(C, A, K, B, nb0, bp, N, op, m0); break;
            default: dispatch_cols_f32<4>(C, A, K, B, nb0, bp, N, op, m0); break;
          }
        }
      }
    }
  });
  return out;
}

// x: [M, K] bf16; packed from pack_weight_int8; scale: [N] per output column.
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                          c10::optional<torch::Tensor> bias, bool out_float32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [M, K] bfloat16");
  TORCH_CHECK(packed.scalar_type() == torch::kInt8, "packed int8 weight expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = (N + kLanes - 1) / kLanes, KP = (K + 1) / 2;
  TORCH_CHECK(packed.size(0) == NB && packed.size(1) == KP, "packed weight does not match [N, K]");
  auto scale_f = scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(scale_f.numel() == N, "one scale per output column");
  torch::Tensor bias_f;
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    bias_f = bias->to(torch::kFloat32).contiguous();
    bp = bias_f.data_ptr<float>();
  }
  auto out = torch::empty({M, N}, x.options().dtype(out_float32 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0) return out;
  const uint16_t* A = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* B = packed.data_ptr<int8_t>();
  const float* sp = scale_f.data_ptr<float>();
  void* op = out.data_ptr();
  const int64_t units = (NB + kCols - 1) / kCols;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t nb0 = u * kCols;
      const int C = static_cast<int>(std::min<int64_t>(kCols, NB - nb0));
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        switch (std::min<int64_t>(kRows, M - m0)) {
          case 1: dispatch_cols_i8<1>(C, A, K, B, KP, nb0, sp, bp, N, out_float32, op, m0); break;
          case 2: dispatch_cols_i8<2>(C, A, K, B, KP, nb0, sp, bp, N, out_float32, op, m0); break;
          case 3: dispatch_cols_i8<3>(C, A, K, B, KP, nb0, sp, bp, N, out_float32, op, m0); break;
          default: dispatch_cols_i8<4>(C, A, K, B, KP, nb0, sp, bp, N, out_float32, op, m0); break;
        }
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------
// Row-wise elementwise helpers: 16 lanes at a time, the tail masked, so the arithmetic
// for column j is the same instruction sequence whatever the row count.
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
// Rounds a float32 vector to T and back (the rounding torch applies between two ops in T).
template <typename T>
inline __m512 round_to(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else {
    __m256i h = f32_to_bf16x16(v);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

// exp for 16 lanes (same polynomial as paged_attention.cpp's).
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

// RMSNorm over the last dim: y = w * T(x * rsqrt(mean(x^2) + eps)), float32 inside.
template <typename T>
void rms_norm_impl(const T* x, const T* w, T* y, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      __m512 ss = _mm512_setzero_ps();
      for (int64_t j = 0; j < n; j += kLanes) {
        const __m512 v = load_row(xr, j, n);
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps);
      const __m512 iv = _mm512_set1_ps(inv);
      for (int64_t j = 0; j < n; j += kLanes) {
        const __m512 normed = round_to<T>(_mm512_mul_ps(load_row(xr, j, n), iv));
        store_row(y + r * n, j, n, _mm512_mul_ps(load_row(w, j, n), normed));
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  TORCH_CHECK(weight.numel() == n, "weight size != last dim");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and input dtypes differ");
  auto y = torch::empty_like(x);
  if (x.scalar_type() == torch::kFloat32) {
    rms_norm_impl<float>(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(), rows, n, eps);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rms_norm supports float32 and bfloat16");
    rms_norm_impl<at::BFloat16>(x.data_ptr<at::BFloat16>(), weight.data_ptr<at::BFloat16>(),
                                y.data_ptr<at::BFloat16>(), rows, n, eps);
  }
  return y;
}

// SwiGLU's elementwise half: gate_up [rows, 2I] -> T(T(silu(gate)) * up) [rows, I].
template <typename T>
void silu_and_mul_impl(const T* gu, T* y, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      for (int64_t j = 0; j < inter; j += kLanes) {
        const __m512 gv = load_row(g, j, inter);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        const __m512 s = round_to<T>(_mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
        store_row(y + r * inter, j, inter, _mm512_mul_ps(s, load_row(u, j, inter)));
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  gate_up = gate_up.contiguous();
  const int64_t two_i = gate_up.size(-1), rows = two_i ? gate_up.numel() / two_i : 0;
  TORCH_CHECK(two_i % 2 == 0, "last dim must be 2 * intermediate");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = two_i / 2;
  auto y = torch::empty(sizes, gate_up.options());
  if (gate_up.scalar_type() == torch::kFloat32) {
    silu_and_mul_impl<float>(gate_up.data_ptr<float>(), y.data_ptr<float>(), rows, two_i / 2);
  } else {
    TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16, "silu_and_mul supports float32 and bfloat16");
    silu_and_mul_impl<at::BFloat16>(gate_up.data_ptr<at::BFloat16>(), y.data_ptr<at::BFloat16>(), rows, two_i / 2);
  }
  return y;
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
  at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
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

torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads) {
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "qkv [T, (Hq + 2 Hkv) D], caches [Hkv, blocks, block, D] contiguous");
  qkv = qkv.contiguous();
  const int64_t T = qkv.size(0), D = k_cache.size(3);
  TORCH_CHECK(D % 2 == 0 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D, "qkv width");
  TORCH_CHECK(k_cache.size(0) == num_kv_heads, "cache kv heads");
  cos = cos.reshape({T, D}).contiguous();
  sin = sin.reshape({T, D}).contiguous();
  auto slots = slot_mapping.to(torch::kInt64).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  TORCH_CHECK(qkv.scalar_type() == k_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type(), "dtypes differ");
  const int64_t cache_rows = k_cache.size(1) * k_cache.size(2);
  auto q = torch::empty({T, num_heads, D}, qkv.options());
  if (qkv.scalar_type() == torch::kFloat32) {
    rope_write_kv_impl<float>(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(),
                              k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), slots.data_ptr<int64_t>(), T,
                              num_heads, num_kv_heads, D, cache_rows);
  } else {
    TORCH_CHECK(qkv.scalar_type() == torch::kBFloat16, "rope_write_kv supports float32 and bfloat16");
    using B = at::BFloat16;
    rope_write_kv_impl<B>(qkv.data_ptr<B>(), cos.data_ptr<B>(), sin.data_ptr<B>(), q.data_ptr<B>(),
                          k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), slots.data_ptr<int64_t>(), T, num_heads,
                          num_kv_heads, D, cache_rows);
  }
  return q;
}

}  // namespace

void register_batch_invariant(pybind11::module& m) {
  m.attr("has_batch_invariant") = true;
  m.def("bi_pack_weight", &pack_weight, "pack [N, K] weights for bi_linear");
  m.def("bi_linear", &linear, "batch-invariant x @ W^T (+ b)", pybind11::arg("x"), pybind11::arg("packed"),
        pybind11::arg("n"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_float32") = false);
  m.def("bi_pack_weight_int8", &pack_weight_int8, "pack [N, K] int8 weights for bi_linear_int8");
  m.def("bi_linear_int8", &linear_int8, "batch-invariant x @ (q * scale)^T (+ b), int8 weights",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scale"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_float32") = false);
  m.def("rope_write_kv", &rope_write_kv, "RoPE on q and k, K/V into the paged cache, q out");
  m.def("bi_rms_norm", &rms_norm, "batch-invariant RMSNorm over the last dim");
  m.def("bi_silu_and_mul", &silu_and_mul, "batch-invariant silu(gate) * up");
}
#else
void register_batch_invariant(pybind11::module& m) { m.attr("has_batch_invariant") = false; }
#endif
