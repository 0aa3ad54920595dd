// Greedy sampling: argmax over float32 logits, and the LM head's greedy fast path.
//
// torch.argmax over a [32, 49152] batch ran on one thread here (0.9 ms of a ~45 ms c32
// step, the other core idle); this one vectorises each row and splits rows across
// threads. Same answer as torch.argmax: the first index of the maximum, and a NaN counts
// as the maximum (the first NaN wins).
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace sluice {

// torch.argmax over one row (also sample.cpp's answer for greedy rows).
int64_t argmax_row(const float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __mmask16 nan = 0;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    mx = _mm512_max_ps(mx, v);
  }
  float m = _mm512_reduce_max_ps(mx);
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) nan = 1;
    m = std::max(m, x[j]);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const __m512 mv = _mm512_set1_ps(m);
  for (i = 0; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), mv, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(eq);
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;  // all -inf: torch returns 0 as well
}

}  // namespace sluice

namespace {


// The k largest of x[0..n) (k <= 16, n >= k): indices into idx, unordered. A running
// threshold (the smallest kept) rejects almost every element with one compare.
void top_k(const float* x, int64_t n, int k, int32_t* idx) {
  float val[16];
  for (int i = 0; i < k; ++i) {
    idx[i] = i;
    val[i] = std::isnan(x[i]) ? -std::numeric_limits<float>::infinity() : x[i];
  }
  auto min_slot = [&] {
    int m = 0;
    for (int i = 1; i < k; ++i)
      if (val[i] < val[m]) m = i;
    return m;
  };
  int slot = min_slot();
  int64_t i = k;
  for (; i < n && i % 16; ++i)
    if (x[i] > val[slot]) { val[slot] = x[i]; idx[slot] = static_cast<int32_t>(i); slot = min_slot(); }
  for (; i + 16 <= n; i += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(val[slot]), _CMP_GT_OQ);
    while (m) {
      const int j = __builtin_ctz(m);
      m &= m - 1;
      if (x[i + j] > val[slot]) { val[slot] = x[i + j]; idx[slot] = static_cast<int32_t>(i + j); slot = min_slot(); }
    }
  }
  for (; i < n; ++i)
    if (x[i] > val[slot]) { val[slot] = x[i]; idx[slot] = static_cast<int32_t>(i); slot = min_slot(); }
}

}  // namespace

// The LM head's greedy fast path. `approx`: [M, V] logits from the int8 x int8 head
// (w8a8_linear), cheap but off by the activations' rounding; `x`: the [M, K] bf16 hidden
// rows; `packed`: the bf16 head as bi_pack_weight packs it. Per row: the k (<= 16) best
// tokens by approx, each rescored exactly as bi_linear computes that logit (the same
// vdpbf16ps chain over k pairs from 0 upward, so the same bits), and the best of those
// (the lowest index on a tie, as torch.argmax). The answer is the full bf16 head's argmax
// whenever that token is among the k, i.e. unless int8 rounding moved it below k others.
at::Tensor greedy_head(at::Tensor approx, at::Tensor x, at::Tensor packed, int64_t k) {
  TORCH_CHECK(approx.dim() == 2 && approx.scalar_type() == at::kFloat, "approx logits must be [M, V] float32");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) == approx.size(0),
              "x must be [M, K] bfloat16, one row per logits row");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
              packed.size(3) == 2, "packed must come from bi_pack_weight (bf16)");
  TORCH_CHECK(k >= 1 && k <= 16, "k must be 1..16");
  approx = approx.contiguous();
  x = x.contiguous();
  const int64_t M = approx.size(0), V = approx.size(1), K = x.size(1), KP = packed.size(1);
  TORCH_CHECK(packed.size(0) * 16 >= V && KP == (K + 1) / 2, "packed weight does not match [V, K]");
  auto out = at::empty({M}, approx.options().dtype(at::kLong));
  const float* ap = approx.data_ptr<float>();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int32_t* wp = reinterpret_cast<const int32_t*>(packed.data_ptr<at::BFloat16>());  // one pair per int32
  int64_t* op = out.data_ptr<int64_t>();
  const int kk = static_cast<int>(std::min<int64_t>(k, V));
  sluice::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      alignas(64) int32_t idx[16] = {0};
      top_k(ap + r * V, V, kk, idx);
      const __mmask16 live = static_cast<__mmask16>((1u << kk) - 1);
      // Lane c: candidate idx[c], whose pair s sits at int32 (group * KP + s) * 16 + lane.
      __m512i lo_base, hi_base;  // 64-bit offsets of pair 0, candidates 0-7 and 8-15
      {
        alignas(64) int64_t b[16];
        for (int c = 0; c < 16; ++c) b[c] = (static_cast<int64_t>(idx[c]) / 16 * KP) * 16 + idx[c] % 16;
        lo_base = _mm512_load_si512(b);
        hi_base = _mm512_load_si512(b + 8);
      }
      // Pair s of the 16 candidates' weights, one candidate per lane (dead lanes zero).
      auto pair_of_candidates = [&](int64_t s) {
        const __m512i step = _mm512_set1_epi64(s * 16);
        const __m256i lo = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), static_cast<__mmask8>(live & 0xFF),
                                                       _mm512_add_epi64(lo_base, step), wp, 4);
        const __m256i hi = _mm512_mask_i64gather_epi32(_mm256_setzero_si256(), static_cast<__mmask8>(live >> 8),
                                                       _mm512_add_epi64(hi_base, step), wp, 4);
        return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      };
      const uint16_t* xr = xp + r * K;
      __m512 acc = _mm512_setzero_ps();
      for (int64_t s = 0; s < K / 2; ++s) {
        int32_t pair;
        std::memcpy(&pair, xr + 2 * s, sizeof(pair));
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(pair), (__m512bh)pair_of_candidates(s));
      }
      if (K % 2)  // odd K: the last k, its partner zero, as bi_linear does
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(xr[K - 1])),
                               (__m512bh)pair_of_candidates(K / 2));
      alignas(64) float ex[16];
      _mm512_store_ps(ex, acc);
      // A candidate whose approx logit is -inf was masked out (structured outputs: the
      // caller applied the grammar's bitmask to approx) and is never the answer; with
      // fewer allowed tokens than candidates, top_k filled the rest with such ones.
      const float* ar = ap + r * V;
      int best = -1;
      for (int c = 0; c < kk; ++c) {
        if (std::isinf(ar[idx[c]]) && ar[idx[c]] < 0) continue;
        if (best < 0 || ex[c] > ex[best] || (ex[c] == ex[best] && idx[c] < idx[best]) ||
            (std::isnan(ex[c]) && !std::isnan(ex[best])))
          best = c;
      }
      op[r] = idx[best < 0 ? 0 : best];
    }
  });
  return out;
}

at::Tensor argmax_rows(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be [B, V] float32");
  logits = logits.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "empty vocabulary");
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  sluice::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) o[b] = sluice::argmax_row(x + b * V, V);
  });
  return out;
}

// Structured outputs: -inf, in place, at every token of logits row rows[r] whose bit in
// bitmask row r is 0 (llguidance's layout: bit j of word i is token 32 i + j; tokens past
// the mask are disallowed too). torch's masked_fill over a [32, 49152] batch took ~4 ms
// here (branchy on a mixed mask); this touches only the words that are not all ones.
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be a contiguous [B, V] float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "bitmask must be a contiguous [R, W] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows must be [R] int64, one logits row per bitmask row");
  const int64_t B = logits.size(0), V = logits.size(1), R = bitmask.size(0), W = bitmask.size(1);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) TORCH_CHECK(rp[r] >= 0 && rp[r] < B, "row index out of range");
  float* lp = logits.data_ptr<float>();
  const uint32_t* mp = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float ninf = -std::numeric_limits<float>::infinity();
  sluice::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* x = lp + rp[r] * V;
      const uint32_t* m = mp + r * W;
      for (int64_t w = 0; w < W && 32 * w < V; ++w) {
        const uint32_t word = m[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t t0 = 32 * w, n = std::min<int64_t>(32, V - t0);
        if (word == 0) {
          std::fill(x + t0, x + t0 + n, ninf);
          continue;
        }
        // A select, not a branch: a mixed word's bits are unpredictable.
        for (int64_t j = 0; j < n; ++j) x[t0 + j] = ((word >> j) & 1u) ? x[t0 + j] : ninf;
      }
      for (int64_t t = 32 * W; t < V; ++t) x[t] = ninf;
    }
  });
}
