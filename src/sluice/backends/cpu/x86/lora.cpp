// LoRA deltas for a step's rows, each row through its own adapter (lora/slots.py): Punica's
// segmented shrink-and-expand, one call per adapted layer whatever the number of adapters.
//
//   y[t] += B_s @ round(A_s @ x[t]),  s = row_slot[t] (-1: no adapter, nothing added)
//
// with the resident adapters stacked per layer: at [S, K, R] (A_s transposed, so the shrink's
// vectors run over the rank) and bt [S, ceil(N / 16), R, 16] (B_s transposed in blocks of 16
// outputs, so the expand's vectors run over outputs and each block is read in one
// sequential pass), R a multiple of 16 (zeros past a slot's rank and past N), ranks[s] the
// rank (summed over the fused layer's parts) of slot s's adapter here, 0 where it does not
// adapt this layer. Float32 sums; the rank-sized middle rounded to
// the model dtype, as PEFT's lora_A output is; y rounded once after the add.
//
// Each sum runs over its index in order with fused multiply-adds (16 lanes of independent
// sums, which the AVX2 builds compute on two halves), so every build gives the same bits;
// each row is computed alone, so its result does not depend on what else is in the batch
// (deterministic mode). Rows are taken grouped by slot, so a thread's rows of one adapter
// read its weights from cache.
#include "aten.h"

#include <cstdint>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"

#include "simd.h"

namespace sluice {
namespace {

constexpr int64_t kLanes = 16;  // the stacks' rank R is a multiple of it (lora/slots.py)

// 16 floats stored in the model dtype (bf16: rounded to nearest even, as torch rounds).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// Up to kRows rows of one adapter are computed together: each weight vector loaded (and
// widened from bf16) once feeds every row's sums. Each row's own sums are the same
// operations in the same order whatever rows it is grouped with.
constexpr int kRows = 4;

// xa[i][j0 .. j0 + 16 NV) = A_s[j0 .., :] @ x_i for M rows: NV x 16 rank sums per row in
// registers over all of K, each as P partial sums over k mod P (independent chains, so few
// rank blocks still keep the multiply-add pipes busy), added in order at the end.
template <int M, int NV, int P, typename W>
inline void shrink_block(const float* const* xf, const W* a, int64_t K, int64_t R, int64_t j0, float* const* xa) {
  __m512 acc[M][P][NV];
  for (int i = 0; i < M; ++i)
    for (int p = 0; p < P; ++p)
      for (int v = 0; v < NV; ++v) acc[i][p][v] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + P <= K; k += P) {
    for (int p = 0; p < P; ++p) {
      const W* ak = a + (k + p) * R + j0;
      for (int v = 0; v < NV; ++v) {
        const __m512 w = load16(ak + kLanes * v);
        for (int i = 0; i < M; ++i) acc[i][p][v] = _mm512_fmadd_ps(_mm512_set1_ps(xf[i][k + p]), w, acc[i][p][v]);
      }
    }
  }
  for (; k < K; ++k) {
    const W* ak = a + k * R + j0;
    for (int v = 0; v < NV; ++v) {
      const __m512 w = load16(ak + kLanes * v);
      for (int i = 0; i < M; ++i) acc[i][0][v] = _mm512_fmadd_ps(_mm512_set1_ps(xf[i][k]), w, acc[i][0][v]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) {
      __m512 sum = acc[i][0][v];
      for (int p = 1; p < P; ++p) sum = _mm512_add_ps(sum, acc[i][p][v]);
      _mm512_storeu_ps(xa[i] + j0 + kLanes * v, sum);
    }
}

// out[i][16 c0 .. 16 (c0 + NV)) = B_s[those outputs, :] @ xa_i for M rows: NV x 16 output
// sums per row in registers over the rank. B_s is stored in blocks of 16 outputs, each
// [R, 16] contiguous, so a block's whole rank is one sequential read.
template <int M, int NV, typename W>
inline void expand_block(const float* const* xa, const W* b, int64_t r, int64_t R, int64_t c0, float* const* out) {
  __m512 acc[M][NV];
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < r; ++j) {
    for (int v = 0; v < NV; ++v) {
      const __m512 w = load16(b + ((c0 + v) * R + j) * kLanes);
      for (int i = 0; i < M; ++i) acc[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(xa[i][j]), w, acc[i][v]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out[i] + (c0 + v) * kLanes, acc[i][v]);
}

// The work of one call in two parallel passes, each over (group, unit) pairs, so that even
// one row's delta (a single stream at c1) is spread over every core:
//   shrink: units of 3 rank blocks (then one of 2 or 1), xa = round(A_s @ x) for the group;
//   expand: units of 2 output blocks (then one of 1), y = round(y + B_s @ xa) there.
// Which units a row's sums fall in depends on its adapter's rank and the layer's width
// only, never on the batch, so every row gets the same operations in the same order.
struct Group {
  int64_t first, m, slot;  // rows[first .. first + m), all of slot `slot`
};

template <int M, typename W>
void shrink_unit(const W* x, const int64_t* rows, const W* a, int64_t r, int64_t K, int64_t R, int64_t u,
                 float* xa, float* xf) {
  float* xfp[kRows];
  float* xap[kRows];
  for (int i = 0; i < M; ++i) {
    xfp[i] = xf + i * K, xap[i] = xa + i * R;
    const W* xt = x + rows[i] * K;
    int64_t k = 0;
    for (; k + kLanes <= K; k += kLanes) _mm512_storeu_ps(xfp[i] + k, load16(xt + k));
    for (; k < K; ++k) xfp[i][k] = to_float(xt[k]);
  }
  const int64_t rv = (r + kLanes - 1) / kLanes;  // rank blocks (past r: zeros in the stack)
  const int64_t v0 = 3 * u, left = std::min<int64_t>(3, rv - v0);
  if (left == 3) shrink_block<M, 3, 1>(xfp, a, K, R, v0 * kLanes, xap);
  else if (left == 2) shrink_block<M, 2, 2>(xfp, a, K, R, v0 * kLanes, xap);
  else shrink_block<M, 1, 4>(xfp, a, K, R, v0 * kLanes, xap);
  const int64_t j1 = std::min<int64_t>(r, (v0 + left) * kLanes);
  for (int i = 0; i < M; ++i)
    for (int64_t j = v0 * kLanes; j < j1; ++j) xap[i][j] = to_float(W(xap[i][j]));  // PEFT's lora_A output dtype
}

template <int M, typename W>
void expand_unit(W* y, const int64_t* rows, const W* b, int64_t r, int64_t N, int64_t R, int64_t u, float* xa,
                 float* out) {
  const float* xap[kRows];
  float* outp[kRows];
  for (int i = 0; i < M; ++i) xap[i] = xa + i * R, outp[i] = out + i * 2 * kLanes;
  const int64_t nb = (N + kLanes - 1) / kLanes;  // output blocks (past N: zeros in the stack)
  const int64_t c0 = 2 * u, nv = std::min<int64_t>(2, nb - c0);
  // expand_block writes out[i][16 c0 ..]: shift the buffers so this unit's land at 0.
  float* shifted[kRows];
  for (int i = 0; i < M; ++i) shifted[i] = outp[i] - c0 * kLanes;
  if (nv == 2) expand_block<M, 2>(xap, b, r, R, c0, shifted);
  else expand_block<M, 1>(xap, b, r, R, c0, shifted);
  const int64_t n0 = c0 * kLanes, n1 = std::min<int64_t>(N, (c0 + nv) * kLanes);
  for (int i = 0; i < M; ++i) {
    W* yt = y + rows[i] * N;
    const float* o = outp[i] - n0;
    int64_t n = n0;
    for (; n + kLanes <= n1; n += kLanes) store16(yt + n, _mm512_add_ps(load16(yt + n), _mm512_loadu_ps(o + n)));
    for (; n < n1; ++n) yt[n] = W(to_float(yt[n]) + o[n]);
  }
}

#define SLUICE_BY_ROWS(m, call) \
  switch (m) {                  \
    case 4: call(4); break;     \
    case 3: call(3); break;     \
    case 2: call(2); break;     \
    default: call(1); break;    \
  }

template <typename W>
void sgmv(W* y, const W* x, const W* at, const W* bt, const int32_t* ranks, const int32_t* row_slot, int64_t M,
          int64_t K, int64_t N, int64_t R, int64_t S) {
  // The rows with an adapter, grouped by slot, in groups of up to kRows rows of one slot.
  std::vector<int64_t> rows;
  std::vector<Group> groups;
  rows.reserve(M);
  for (int64_t s = 0; s < S; ++s) {
    if (ranks[s] <= 0) continue;
    const int64_t first = static_cast<int64_t>(rows.size());
    for (int64_t t = 0; t < M; ++t)
      if (row_slot[t] == s) rows.push_back(t);
    for (int64_t g = first; g < static_cast<int64_t>(rows.size()); g += kRows)
      groups.push_back({g, std::min<int64_t>(kRows, static_cast<int64_t>(rows.size()) - g), s});
  }
  if (groups.empty()) return;
  const int64_t NP = (N + kLanes - 1) / kLanes * kLanes, nb = NP / kLanes;
  std::vector<float> xa(groups.size() * kRows * R);
  // A pass: units_of(group) units per group, each run by fn(group, its index, unit, buffer)
  // with a buffer of `scratch` floats per thread.
  auto pass = [&](auto units_of, int64_t scratch, auto fn) {
    std::vector<std::pair<int64_t, int64_t>> units;  // (group, unit)
    for (int64_t g = 0; g < static_cast<int64_t>(groups.size()); ++g)
      for (int64_t u = 0; u < units_of(groups[g]); ++u) units.emplace_back(g, u);
    sluice::parallel_for(0, static_cast<int64_t>(units.size()), 1, [&](int64_t begin, int64_t end) {
      std::vector<float> buf(scratch);
      for (int64_t i = begin; i < end; ++i) fn(groups[units[i].first], units[i].first, units[i].second, buf.data());
    });
  };
  pass([&](const Group& gr) { return ((ranks[gr.slot] + kLanes - 1) / kLanes + 2) / 3; }, kRows * K,
       [&](const Group& gr, int64_t g, int64_t u, float* xf) {
#define SLUICE_SHRINK(m) \
  shrink_unit<m>(x, rows.data() + gr.first, at + gr.slot * K * R, ranks[gr.slot], K, R, u, xa.data() + g * kRows * R, xf)
         SLUICE_BY_ROWS(gr.m, SLUICE_SHRINK)
#undef SLUICE_SHRINK
       });
  pass([&](const Group&) { return (nb + 1) / 2; }, kRows * 2 * kLanes,
       [&](const Group& gr, int64_t g, int64_t u, float* out) {
#define SLUICE_EXPAND(m) \
  expand_unit<m>(y, rows.data() + gr.first, bt + gr.slot * R * NP, ranks[gr.slot], N, R, u, xa.data() + g * kRows * R, out)
         SLUICE_BY_ROWS(gr.m, SLUICE_EXPAND)
#undef SLUICE_EXPAND
       });
}
#undef SLUICE_BY_ROWS

}  // namespace

void lora_sgmv(at::Tensor y, at::Tensor x, at::Tensor at_, at::Tensor bt, at::Tensor ranks, at::Tensor row_slot) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0), "x must be [M, K] and y [M, N]");
  TORCH_CHECK(at_.dim() == 3 && bt.dim() == 4 && at_.size(0) == bt.size(0) && at_.size(2) == bt.size(2) &&
                  bt.size(3) == kLanes, "A must be [S, K, R] and B [S, ceil(N / 16), R, 16]");
  TORCH_CHECK(at_.size(1) == x.size(1) && bt.size(1) == (y.size(1) + kLanes - 1) / kLanes,
              "A and B do not match x and y");
  TORCH_CHECK(x.scalar_type() == y.scalar_type() && x.scalar_type() == at_.scalar_type() &&
                  x.scalar_type() == bt.scalar_type(), "x, y, A and B must share one dtype");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && row_slot.scalar_type() == at::kInt &&
                  ranks.numel() == at_.size(0) && row_slot.numel() == x.size(0),
              "ranks must be int32 [S] and row_slot int32 [M]");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && at_.is_contiguous() && bt.is_contiguous() &&
                  ranks.is_contiguous() && row_slot.is_contiguous(), "every tensor must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = y.size(1), R = at_.size(2), S = at_.size(0);
  const int32_t* rk = ranks.data_ptr<int32_t>();
  TORCH_CHECK(R % kLanes == 0, "R must be a multiple of ", kLanes);
  for (int64_t s = 0; s < S; ++s) TORCH_CHECK(rk[s] >= 0 && rk[s] <= R, "a slot's rank is past R");
  if (x.scalar_type() == at::kBFloat16) {
    sgmv(y.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), at_.data_ptr<at::BFloat16>(),
         bt.data_ptr<at::BFloat16>(), rk, row_slot.data_ptr<int32_t>(), M, K, N, R, S);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "lora_sgmv supports float32 and bfloat16");
    sgmv(y.data_ptr<float>(), x.data_ptr<float>(), at_.data_ptr<float>(), bt.data_ptr<float>(), rk,
         row_slot.data_ptr<int32_t>(), M, K, N, R, S);
  }
}

}  // namespace sluice
