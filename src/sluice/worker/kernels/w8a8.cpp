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
//
// Every output element is reduced in an order fixed by its row alone (blocks in order,
// k in order within a block, a row quantized by itself), so these kernels are
// batch-invariant like batch_invariant.cpp's.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#include "simd.h"

namespace sluice {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 32;              // k per activation scale
constexpr int kStepsPerBlock = kBlock / 4;  // vpdpbusd takes 4 k per lane
constexpr int kRows = 4;                // register block: kRows x kCols int32 + as many float32
constexpr int kCols = 3;

// acc += w (unsigned bytes) . x (signed bytes), 4 per lane. Written as asm because GCC
// copies every accumulator to a fresh register around the intrinsic (two extra moves
// per multiply-add in the inner loop, measured ~1.5x slower).
// The four activation bytes are broadcast from memory by the instruction itself.
inline void dpbusd(__m512i& acc, __m512i w, const int8_t* x4) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x4)));
}

int64_t padded_k(int64_t K) { return (K + kBlock - 1) / kBlock * kBlock; }

}  // namespace

// One row of x (K bf16) -> its int8 values, per-block scales and offset correction, in
// rows' row r: what the +128 weight offset adds is corr = 128 * sum over blocks of
// scale * sum(q). Every row is quantized alone, so a row's values never depend on its batch.
void w8a8_quantize_row(const uint16_t* xr, W8A8Rows& rows, int64_t r) {
  const int64_t K = rows.K, Kp = padded_k(K), nblk = Kp / kBlock;
  int8_t* q = rows.q.data_ptr<int8_t>() + r * Kp;
  float* scales = rows.scales.data_ptr<float>() + r * nblk;
  float c = 0.0f;
  for (int64_t b = 0; b < nblk; ++b) {
    __m512 v[kBlock / kLanes];
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < kBlock / kLanes; ++i) {
      const int64_t k0 = b * kBlock + i * kLanes, left = K - k0;
      const __mmask16 m = left >= kLanes ? static_cast<__mmask16>(0xFFFF)
                          : left > 0    ? static_cast<__mmask16>((1u << left) - 1)
                                        : static_cast<__mmask16>(0);
      const __m256i raw = _mm256_maskz_loadu_epi16(m, xr + k0);
      v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float mx = _mm512_reduce_max_ps(amax);
    const float d = mx / 127.0f, id = mx > 0.0f ? 127.0f / mx : 0.0f;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < kBlock / kLanes; ++i) {
      // Round to nearest even (the default rounding mode); |x * id| <= 127 by construction.
      const __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(id)));
      sum = _mm512_add_epi32(sum, qi);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + b * kBlock + i * kLanes), _mm512_cvtsepi32_epi8(qi));
    }
    scales[b] = d;
    c += d * static_cast<float>(_mm512_reduce_add_epi32(sum));
  }
  rows.corr.data_ptr<float>()[r] = 128.0f * c;
}

W8A8Rows w8a8_rows(int64_t M, int64_t K, const torch::TensorOptions& options) {
  const int64_t Kp = padded_k(K);
  return {torch::empty({M, Kp}, options.dtype(torch::kInt8)),
          torch::empty({M, Kp / kBlock}, options.dtype(torch::kFloat32)),
          torch::empty({M}, options.dtype(torch::kFloat32)), K};
}

namespace {

// R rows x C groups of 16 columns. Per block: int32 sums of kBlock k, then one
// float multiply-add by the row's block scale; at the end the offset term and the
// column scales.
template <int R, int C>
void block(const uint8_t* w, int64_t KS, const int8_t* q, const float* scales, const float* corr, int64_t Kp,
           int64_t nb0, const float* wscale, const float* bias, int64_t N, bool out_f32, void* out, int64_t m0,
           Prefetch pf) {
  const int64_t nblk = Kp / kBlock;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    __m512i isum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) isum[r][c] = _mm512_setzero_si512();
    pf.step();
    for (int s = 0; s < kStepsPerBlock; ++s) {
      const int64_t step = b * kStepsPerBlock + s;
      __m512i wv[C];
      for (int c = 0; c < C; ++c) wv[c] = _mm512_loadu_si512(w + ((nb0 + c) * KS + step) * kLanes * 4);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) dpbusd(isum[r][c], wv[c], q + (m0 + r) * Kp + step * 4);
    }
    for (int r = 0; r < R; ++r) {
      const __m512 d = _mm512_set1_ps(scales[(m0 + r) * nblk + b]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), d, acc[r][c]);
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
void block_cols(int C, const uint8_t* w, int64_t KS, const int8_t* q, const float* scales, const float* corr,
                int64_t Kp, int64_t nb0, const float* wscale, const float* bias, int64_t N, bool out_f32, void* out,
                int64_t m0, Prefetch pf) {
  switch (C) {
    case 1: return block<R, 1>(w, KS, q, scales, corr, Kp, nb0, wscale, bias, N, out_f32, out, m0, pf);
    case 2: return block<R, 2>(w, KS, q, scales, corr, Kp, nb0, wscale, bias, N, out_f32, out, m0, pf);
    default: return block<R, kCols>(w, KS, q, scales, corr, Kp, nb0, wscale, bias, N, out_f32, out, m0, pf);
  }
}

}  // namespace

// q: [N, K] int8 -> [N/16][Kp/4][16][4] uint8 holding q + 128, N padded to 16 and K to
// a whole block (the padding's activations are zero, so its weights do not matter).
torch::Tensor w8a8_pack_weight(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kInt8, "int8 weight must be [N, K] int8");
  q = q.contiguous();
  const int64_t N = q.size(0), K = q.size(1), NB = (N + kLanes - 1) / kLanes, KS = padded_k(K) / 4;
  auto out = torch::full({NB, KS, kLanes, 4}, 128, q.options().dtype(torch::kUInt8));
  const int8_t* src = q.data_ptr<int8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k)
      dst[(((n / kLanes) * KS + k / 4) * kLanes + n % kLanes) * 4 + k % 4] = static_cast<uint8_t>(src[n * K + k] + 128);
  return out;
}

// x: [M, K] bf16; packed from w8a8_pack_weight; scale: [N] per output column. Returns
// [M, N] bf16, or float32 when out_float32 (the LM head).
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                          c10::optional<torch::Tensor> bias, bool out_float32) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be [M, K] bfloat16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  W8A8Rows rows = w8a8_rows(M, K, x.options());
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) w8a8_quantize_row(xp + r * K, rows, r);
  });
  return linear_w8a8_rows(rows, packed, scale, N, bias, out_float32);
}

// The linear layer over activations already quantized (by linear_w8a8, or by a fused
// norm or SwiGLU that quantizes each row as it makes it: one pass and one parallel
// region fewer than producing bf16 rows and quantizing them here).
torch::Tensor linear_w8a8_rows(const W8A8Rows& x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                               c10::optional<torch::Tensor> bias, bool out_float32) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8, "weights packed by w8a8_pack_weight expected");
  const int64_t M = x.q.size(0), K = x.K, Kp = padded_k(K), KS = Kp / 4;
  TORCH_CHECK(packed.size(0) == (N + kLanes - 1) / kLanes && packed.size(1) == KS, "packed weight does not match [N, K]");
  auto scale_f = scale.to(torch::kFloat32).contiguous();
  TORCH_CHECK(scale_f.numel() == N, "one scale per output column");
  const auto bias_f = float_or_empty(bias);
  auto out = torch::empty({M, N}, x.q.options().dtype(out_float32 ? torch::kFloat32 : torch::kBFloat16));
  if (M == 0) return out;
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int8_t* qp = x.q.data_ptr<int8_t>();
  const float *sp = x.scales.data_ptr<float>(), *cp = x.corr.data_ptr<float>(), *ws = scale_f.data_ptr<float>();
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  void* op = out.data_ptr();
  const int64_t NB = (N + kLanes - 1) / kLanes, units = (NB + kCols - 1) / kCols;
  std::vector<std::pair<int64_t, int>> rows;  // (first row, rows) of each row block
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const int r = left >= kRows ? kRows : left >= 2 ? 2 : 1;
    rows.emplace_back(m0, r);
    m0 += r;
  }
  // Threads split column units; each unit's weight panel is reused by every row block,
  // and its passes prefetch the thread's next panel (simd.h's Prefetch; 8 rows 5.9 -> 4.6
  // ms and 32 rows 13.6 -> 11.5-13.6 ms for the 120 layers).
  parallel_units(units, M > kBalanceRows, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t nb0 = u * kCols;
      const int C = static_cast<int>(std::min<int64_t>(kCols, NB - nb0));
      const int64_t passes = static_cast<int64_t>(rows.size());
      const char* next = u + 1 < end && passes <= kPrefetchMaxPasses
                             ? reinterpret_cast<const char*>(w + (nb0 + kCols) * KS * kLanes * 4) : nullptr;
      const int64_t next_lines = next ? std::min<int64_t>(kCols, NB - nb0 - kCols) * KS * kLanes * 4 / 64 : 0;
      const int64_t nblk = Kp / kBlock;
      for (int64_t p = 0; p < passes; ++p) {
        const auto [m0, r] = rows[p];
        const Prefetch pf = Prefetch::share(next, next_lines, p, passes, nblk);
        switch (r) {
          case 1: block_cols<1>(C, w, KS, qp, sp, cp, Kp, nb0, ws, bp, N, out_float32, op, m0, pf); break;
          case 2: block_cols<2>(C, w, KS, qp, sp, cp, Kp, nb0, ws, bp, N, out_float32, op, m0, pf); break;
          default: block_cols<kRows>(C, w, KS, qp, sp, cp, Kp, nb0, ws, bp, N, out_float32, op, m0, pf); break;
        }
      }
    }
  });
  return out;
}

}  // namespace sluice

void register_w8a8(pybind11::module& m) {
  m.attr("has_w8a8") = true;
  m.def("w8a8_pack_weight", &sluice::w8a8_pack_weight, "pack [N, K] int8 weights for w8a8_linear");
  m.def("w8a8_linear", &sluice::linear_w8a8, "x @ (q * scale)^T (+ b), x quantized to int8 per block of 32",
        pybind11::arg("x"), pybind11::arg("packed"), pybind11::arg("scale"), pybind11::arg("n"),
        pybind11::arg("bias") = pybind11::none(), pybind11::arg("out_float32") = false);
}
#else
#if defined(__AVX512F__) && defined(__AVX512BF16__)
// kernels.h declares it for the decoder stack, which only calls it when has_w8a8 is true.
torch::Tensor sluice::linear_w8a8(torch::Tensor, torch::Tensor, torch::Tensor, int64_t, c10::optional<torch::Tensor>,
                                  bool) {
  TORCH_CHECK(false, "w8a8 needs a CPU with AVX-512 VNNI");
}
sluice::W8A8Rows sluice::w8a8_rows(int64_t, int64_t, const torch::TensorOptions&) {
  TORCH_CHECK(false, "w8a8 needs a CPU with AVX-512 VNNI");
}
void sluice::w8a8_quantize_row(const uint16_t*, W8A8Rows&, int64_t) {
  TORCH_CHECK(false, "w8a8 needs a CPU with AVX-512 VNNI");
}
torch::Tensor sluice::linear_w8a8_rows(const W8A8Rows&, torch::Tensor, torch::Tensor, int64_t,
                                       c10::optional<torch::Tensor>, bool) {
  TORCH_CHECK(false, "w8a8 needs a CPU with AVX-512 VNNI");
}
#endif
void register_w8a8(pybind11::module& m) { m.attr("has_w8a8") = false; }
#endif
