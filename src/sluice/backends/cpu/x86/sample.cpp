// Sampling from float32 logits in one call: temperature, top-k, top-p, min-p and the draw.
//
// What the torch sampler (worker/sampler.py) does with a dozen whole-batch ops, row by row
// in one pass or two over a buffer that stays in cache: over a [32, 49152] batch those ops
// took ~1.1 ms a step here (the division by the temperature, softmax and float64 running
// sums each write a new [B, V] tensor, the top-k / top-p path sorts every row), about as
// long as the LM head's int8 copy takes to read. Clients that send no temperature get
// OpenAI's default of 1, so this is every such client's step.
//
// The same distribution as sampler.py, row by row:
//   * temperature 0: the argmax (argmax_row: torch.argmax's answer, NaN and ties included);
//   * else l = x / T; top-k keeps the tokens with x at least the k-th largest (ties at the
//     boundary all kept; torch's sort keeps an arbitrary k of them); top-p drops tokens in
//     ascending order of probability while the dropped mass, taken inclusively, is at most
//     1 - p of the kept mass (the most likely token always stays), as apply_top_k_top_p;
//     min-p drops tokens whose probability is below min_p times the largest;
//   * the draw: the first token whose running sum of exp(l - max l), in vocabulary order
//     and in float64, passes u times the total (sampler.py's inverse CDF, the same u).
// Probabilities are exp16's (relative error ~1e-7) where torch's softmax uses its own exp,
// so a draw can differ from sampler.py's only where u lands within that rounding of a
// token's boundary. Every row is computed alone, in an order that depends on that row only:
// a row's token never depends on its batch, and every build gives the same bits (the sums
// are scalar float64 in a fixed order; the vector ops are lane by lane).
#include "aten.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace sluice {
namespace {

constexpr int64_t kSumBlock = 256;  // tokens per partial sum of the draw's search

// Where each thread keeps a row's weights exp(l - max l) and the top-p candidates: made
// once per thread and grown to the vocabulary (a fresh [V] buffer a row would page-fault).
struct Scratch {
  std::vector<float> e;
  std::vector<double> blocks;
  std::vector<std::pair<float, int32_t>> cand;
  std::vector<float> heap;
  std::vector<double> hist;
};
Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

// x[0..n) -> e[i] = exp(x[i] / t - m) (m = max x / t), 0 where x[i] is -inf or NaN (masked
// tokens stay impossible: exp16 clamps its argument, so it never gives 0 itself).
void weights(const float* x, int64_t n, float t, float m, float* e) {
  const __m512 tv = _mm512_set1_ps(t), mv = _mm512_set1_ps(m), ninf = _mm512_set1_ps(-INFINITY);
  auto of = [&](__m512 v) {
    const __mmask16 live = _mm512_cmp_ps_mask(v, ninf, _CMP_GT_OQ);
    return _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_div_ps(v, tv), mv)));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(e + i, of(_mm512_loadu_ps(x + i)));
  if (i < n) {  // the tail, padded with -inf (weight 0)
    alignas(64) float in[16], out[16];
    std::fill(in, in + 16, -INFINITY);
    std::copy(x + i, x + n, in);
    _mm512_store_ps(out, of(_mm512_load_ps(in)));
    std::copy(out, out + (n - i), e + i);
  }
}

float row_max(const float* x, int64_t n) {
  __m512 mx = _mm512_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(x + i));
  float m = _mm512_reduce_max_ps(mx);
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// The k-th largest finite-or-inf value of x (NaN and -inf skipped), or -inf when fewer
// than k tokens are live: a min-heap of the k best, most elements rejected by one compare
// with its smallest.
float kth_largest(const float* x, int64_t n, int64_t k, std::vector<float>& heap) {
  heap.clear();
  auto greater = std::greater<float>();
  int64_t i = 0;
  for (; i < n && static_cast<int64_t>(heap.size()) < k; ++i)
    if (x[i] > -INFINITY) {
      heap.push_back(x[i]);
      std::push_heap(heap.begin(), heap.end(), greater);
    }
  if (static_cast<int64_t>(heap.size()) < k) return -INFINITY;
  auto offer = [&](float v) {
    if (v > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), greater);
      heap.back() = v;
      std::push_heap(heap.begin(), heap.end(), greater);
    }
  };
  for (; i < n && i % 16; ++i) offer(x[i]);
  for (; i + 16 <= n; i += 16) {
    __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(heap.front()), _CMP_GT_OQ);
    while (m) {
      const int j = __builtin_ctz(m);
      m &= m - 1;
      offer(x[i + j]);
    }
  }
  for (; i < n; ++i) offer(x[i]);
  return heap.front();
}

// Sum of e[0..n) in float64: eight interleaved chains (one chain is bound by the add's
// latency), combined in a fixed order.
double sum64(const float* e, int64_t n) {
  double s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += static_cast<double>(e[i + j]);
  for (; i < n; ++i) s[0] += static_cast<double>(e[i]);
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// top-p over e (zeros are dropped tokens already): apply_top_k_top_p's rule, without
// sorting the row. A histogram of the weights' mass by their top 12 bits (sign, exponent
// and 3 mantissa bits: buckets 9% wide, ordered as the weights) finds the bucket where the
// ascending running sum crosses the cut: every token below it is dropped and every token
// above it kept, whatever their order, and only that bucket's tokens are sorted. Sorting
// the row (torch's way) took ~1.7 ms a row of 49k on flat logits, this ~0.1 ms.
void top_p_cut(float* e, int64_t n, double p, Scratch& s) {
  const double total = sum64(e, n);
  const double cut = (1.0 - p) * total;
  if (!(total > 0.0) || cut <= 0.0) return;
  constexpr int kBuckets = 1024, kWays = 4;  // weights are at most 1: bucket (bits >> 20) <= 0x3F8
  s.hist.assign(kBuckets * kWays, 0.0);
  double* h = s.hist.data();
  auto bucket = [](float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof(bits));
    return static_cast<int>(bits >> 20);
  };
  // Four interleaved histograms: one would wait on its own store whenever neighbours share a bucket.
  int64_t i = 0;
  for (; i + kWays <= n; i += kWays)
    for (int w = 0; w < kWays; ++w) h[w * kBuckets + bucket(e[i + w])] += static_cast<double>(e[i + w]);
  for (; i < n; ++i) h[bucket(e[i])] += static_cast<double>(e[i]);
  double dropped = 0.0;
  int edge = 0;  // bucket 0 also holds the zeros, which add nothing
  for (; edge < kBuckets; ++edge) {
    const double m = h[edge] + h[kBuckets + edge] + h[2 * kBuckets + edge] + h[3 * kBuckets + edge];
    if (dropped + m > cut) break;
    dropped += m;
  }
  auto& cand = s.cand;
  cand.clear();
  for (i = 0; i < n; ++i) {
    const int b = bucket(e[i]);
    if (b < edge) e[i] = 0.0f;
    else if (b == edge && e[i] > 0.0f) cand.emplace_back(e[i], static_cast<int32_t>(i));
  }
  // Ascending; among equal weights the higher index first (a fixed order; torch's is its sort's).
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first < b.first || (a.first == b.first && a.second > b.second);
  });
  for (size_t c = 0; c + 1 < cand.size(); ++c) {  // the most likely token always stays
    dropped += cand[c].first;
    if (dropped > cut) break;
    e[cand[c].second] = 0.0f;
  }
}

// The first token whose running float64 sum of e passes u times the total.
int64_t draw(const float* e, int64_t n, double u, std::vector<double>& blocks) {
  const int64_t nb = (n + kSumBlock - 1) / kSumBlock;
  blocks.resize(nb);
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    blocks[b] = sum64(e + b * kSumBlock, std::min(kSumBlock, n - b * kSumBlock));
    total += blocks[b];
  }
  const double thr = u * total;
  double cum = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (cum + blocks[b] <= thr) {
      cum += blocks[b];
      continue;
    }
    const int64_t lo = b * kSumBlock, hi = std::min(n, lo + kSumBlock);
    double c = cum;
    for (int64_t i = lo; i < hi; ++i) {
      c += static_cast<double>(e[i]);
      if (e[i] > 0.0f && c > thr) return i;
    }
    cum += blocks[b];
  }
  for (int64_t i = n - 1; i >= 0; --i)  // rounding put u * total past the last sum: the last token with weight
    if (e[i] > 0.0f) return i;
  return -1;
}

int64_t sample_row(const float* x, int64_t V, float t, double u, int64_t top_k, double top_p, float min_p) {
  if (!(t > 0.0f)) return argmax_row(x, V);
  const float mx = row_max(x, V);
  if (!std::isfinite(mx)) return argmax_row(x, V);  // nothing finite, an inf or a NaN: as greedy
  Scratch& s = scratch();
  s.e.resize(V);
  float* e = s.e.data();
  weights(x, V, t, mx / t, e);
  if (top_k > 0 && top_k < V) {
    const float kth = kth_largest(x, V, top_k, s.heap);
    for (int64_t i = 0; i < V; ++i)
      if (!(x[i] >= kth)) e[i] = 0.0f;
  }
  if (top_p < 1.0) top_p_cut(e, V, top_p, s);
  if (min_p > 0.0f)  // the largest weight is exp(0) = 1 exactly, and it always stays
    for (int64_t i = 0; i < V; ++i)
      if (e[i] < min_p) e[i] = 0.0f;
  const int64_t tok = draw(e, V, u, s.blocks);
  return tok < 0 ? argmax_row(x, V) : tok;
}

}  // namespace
}  // namespace sluice

at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor u, c10::optional<at::Tensor> top_k,
                       c10::optional<at::Tensor> top_p, c10::optional<at::Tensor> min_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits must be [B, V] float32");
  logits = logits.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V < (int64_t{1} << 31), "vocabulary size out of range");
  auto per_row = [&](const at::Tensor& t, at::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B, name, " must have one value per row");
    return t.to(type).contiguous();
  };
  const at::Tensor temp = per_row(temperature, at::kFloat, "temperature");
  const at::Tensor uu = per_row(u.reshape({-1}), at::kDouble, "u");
  const at::Tensor tk = top_k ? per_row(*top_k, at::kLong, "top_k") : at::Tensor();
  const at::Tensor tp = top_p ? per_row(*top_p, at::kDouble, "top_p") : at::Tensor();
  const at::Tensor mp = min_p ? per_row(*min_p, at::kFloat, "min_p") : at::Tensor();
  auto out = at::empty({B}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  const float* tv = temp.data_ptr<float>();
  const double* uv = uu.data_ptr<double>();
  const int64_t* kv = tk.defined() ? tk.data_ptr<int64_t>() : nullptr;
  const double* pv = tp.defined() ? tp.data_ptr<double>() : nullptr;
  const float* mv = mp.defined() ? mp.data_ptr<float>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  sluice::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = sluice::sample_row(x + r * V, V, tv[r], uv[r], kv ? kv[r] : 0, pv ? pv[r] : 1.0, mv ? mv[r] : 0.0f);
  });
  return out;
}
