// Q6_K weights in their own form x int8 activations (`--quantization gguf`): a Q4_K_M
// file's ffn_down, attn_v and output matrices are Q6_K, whose scales cover 16 k each,
// which no per-32 block form (w4a8.cpp) holds exactly.
//
// Format (q6k_pack_weight): per weight w = d * sc * (q - 32), q in 0..63, sc an int8 per
// 16 k, d a float per 256 k (quantization/gguf_blocks.py Q6KBlocks). q is kept in 6 bits
// as llama.cpp keeps it: its low 4 bits two steps to a byte (w4a8's nibble layout,
// [N/16][K/8][16][4]) and its top 2 bits four steps to a byte ([N/16][K/16][16][4], step
// 4j + t in bits 2t..2t+1); 6.6 bits a weight with the scales, against the 8-bit
// requantization's 9.
//
// Per half-block of 16 k, an output element's int32 sum starts at -32 * sum(qx) over the
// half (the activations' half sums, made once per step) and adds q * qx, 4 k per lane
// (vpdpbusd; the plain AVX2 build's vpmaddubsw takes q as its unsigned operand, pairs at
// most 2 * 63 * 127: no saturation), so it is sum((q - 32) * qx) exactly on every build.
// Then acc = fma(float(isum), (d * sc) * sx, acc), half by half: d * sc is exact in
// float32 (a float16 by an int8), sx the activation block's scale. Every output is
// reduced in an order fixed by its row alone, and every build does the same integer and
// float operations: batch-invariant, and the same bits on the avx512, avx2_vnni and avx2
// builds.
#include "aten.h"

#include <cstdint>
#include <cstring>

#include "kernels.h"

#include "simd.h"

namespace sluice {
namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 32;   // k per activation scale
constexpr int kHalf = 16;    // k per weight scale (sc)
constexpr int kSuper = 256;  // k per d
constexpr int kRows = 4;
#if defined(SLUICE_AVX2)
constexpr int kCols = 1;  // 16 ymm registers: one group of 16 columns at a time
#else
constexpr int kCols = 3;
#endif

// Step t (0..3) of a half-block as unsigned bytes q: lo holds steps 2i (low nibbles) and
// 2i + 1 (high) for i = t / 2, hi the top two bits of all four (bits 2t..2t+1). Shifts are
// of 16-bit lanes: bits that cross into the neighbouring byte land outside 0x30 or 0x0F.
inline __m512i unpack_q6(__m512i lo, __m512i hi, int t) {
  const __m512i l = t % 2 ? srli16(lo, 4) : lo;
  const __m512i h = t < 2 ? slli16(hi, 4 - 2 * t) : t == 2 ? hi : srli16(hi, 2);
  return merge_bits(l, h, 0x0F0F0F0F, 0x30303030);  // simd.h
}

// 16 int8 scales as float32 lanes.
inline __m512 scales16(const int8_t* sc) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))));
}

struct Q6Weights {
  const uint8_t* lo;  // [NB][KS/2][16][4]
  const uint8_t* hi;  // [NB][KS/4][16][4]
  const int8_t* sc;   // [NB][Kp/16][16]
  const float* d;     // [NB][Kp/256][16]
  int64_t KS;         // steps of 4 k
};

struct Q6Acts {
  const int8_t* q;       // [M, Kp]
  const float* scales;   // [M, Kp/32]
  const int32_t* hsums;  // [M, Kp/16]: each half-block's sum(qx)
  int64_t Kp;
};

template <int R, int C>
void block(const Q6Weights& w, const Q6Acts& x, int64_t nb0, const float* bias, int64_t N, bool out_f32, void* out,
           int64_t m0, Prefetch pf) {
  const int64_t Kp = x.Kp, nblk = Kp / kBlock, nhalf = Kp / kHalf, nsup = Kp / kSuper, KS = w.KS;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nblk; ++b) {
    pf.step();
    for (int h = 0; h < 2; ++h) {
      const int64_t half = 2 * b + h, step0 = half * 4;
      __m512i isum[R][C];
      for (int r = 0; r < R; ++r) {
        const __m512i start = _mm512_set1_epi32(-32 * x.hsums[(m0 + r) * nhalf + half]);
        for (int c = 0; c < C; ++c) isum[r][c] = start;
      }
      for (int t = 0; t < 4; ++t) {
        const int64_t step = step0 + t;
        __m512i wv[C];
        for (int c = 0; c < C; ++c) {
          const __m512i lo = _mm512_loadu_si512(w.lo + ((nb0 + c) * (KS / 2) + step / 2) * kLanes * 4);
          const __m512i hi = _mm512_loadu_si512(w.hi + ((nb0 + c) * (KS / 4) + step / 4) * kLanes * 4);
          wv[c] = unpack_q6(lo, hi, t);
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c)
            isum[r][c] = dot4_unsigned_signed(isum[r][c], wv[c], x.q + (m0 + r) * Kp + step * 4);
      }
      __m512 dsc[C];
      for (int c = 0; c < C; ++c)
        dsc[c] = _mm512_mul_ps(_mm512_loadu_ps(w.d + ((nb0 + c) * nsup + b * kBlock / kSuper) * kLanes),
                               scales16(w.sc + ((nb0 + c) * nhalf + half) * kLanes));
      for (int r = 0; r < R; ++r) {
        const __m512 sx = _mm512_set1_ps(x.scales[(m0 + r) * nblk + b]);
        for (int c = 0; c < C; ++c)
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][c]), _mm512_mul_ps(dsc[c], sx), acc[r][c]);
      }
    }
  }
  store_rows<R, C>(acc, bias, N, out_f32, out, m0, nb0);
}

template <int R>
void block_cols(int C, const Q6Weights& w, const Q6Acts& x, int64_t nb0, const float* bias, int64_t N, bool out_f32,
                void* out, int64_t m0, Prefetch pf) {
  if constexpr (kCols == 1) {
    for (int c = 0; c < C; ++c) block<R, 1>(w, x, nb0 + c, bias, N, out_f32, out, m0, pf);
  } else {
    switch (C) {
      case 1: return block<R, 1>(w, x, nb0, bias, N, out_f32, out, m0, pf);
      case 2: return block<R, 2>(w, x, nb0, bias, N, out_f32, out, m0, pf);
      default: return block<R, kCols>(w, x, nb0, bias, N, out_f32, out, m0, pf);
    }
  }
}

void check_packed(const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& d, const at::Tensor& sc, int64_t NB,
                  int64_t Kp) {
  TORCH_CHECK(Kp % kSuper == 0, "Q6_K rows are whole super-blocks of 256");
  const int64_t KS = Kp / 4;
  TORCH_CHECK(lo.scalar_type() == at::kByte && lo.is_contiguous() && lo.numel() == NB * KS / 2 * kLanes * 4 &&
                  hi.scalar_type() == at::kByte && hi.is_contiguous() && hi.numel() == NB * KS / 4 * kLanes * 4 &&
                  sc.scalar_type() == at::kChar && sc.is_contiguous() && sc.numel() == NB * (Kp / kHalf) * kLanes &&
                  d.scalar_type() == at::kFloat && d.is_contiguous() && d.numel() == NB * (Kp / kSuper) * kLanes,
              "Q6_K weights packed by q6k_pack_weight, matching [N, K], expected");
}

}  // namespace

// q: [N, K] uint8 in 0..63, sc: [N, K/16] int8, d: [N, K/256] float32 (K a multiple of 256)
// -> (low nibbles [N/16][K/8][16][4], top bits [N/16][K/16][16][4], sc [N/16][K/16][16],
// d [N/16][K/256][16]), N padded to 16 with zero weights and scales.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> q6k_pack_weight(at::Tensor q, at::Tensor sc,
                                                                           at::Tensor d) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kByte, "Q6_K weights must be [N, K] uint8");
  const int64_t N = q.size(0), K = q.size(1), NB = (N + kLanes - 1) / kLanes, KS = K / 4;
  TORCH_CHECK(K % kSuper == 0, "Q6_K rows are whole super-blocks of 256");
  TORCH_CHECK(q.numel() == 0 || q.max().item<uint8_t>() <= 63, "Q6_K weights must lie in 0..63");
  TORCH_CHECK(sc.scalar_type() == at::kChar && sc.dim() == 2 && sc.size(0) == N && sc.size(1) == K / kHalf &&
                  d.dim() == 2 && d.size(0) == N && d.size(1) == K / kSuper,
              "one int8 scale per 16 k and one float per 256 k of each row");
  q = q.contiguous();
  sc = sc.contiguous();
  d = d.to(at::kFloat).contiguous();
  auto lo = at::zeros({NB, KS / 2, kLanes, 4}, q.options());
  auto hi = at::zeros({NB, KS / 4, kLanes, 4}, q.options());
  auto osc = at::zeros({NB, K / kHalf, kLanes}, sc.options());
  auto od = at::zeros({NB, K / kSuper, kLanes}, d.options());
  const uint8_t* src = q.data_ptr<uint8_t>();
  uint8_t* plo = lo.data_ptr<uint8_t>();
  uint8_t* phi = hi.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t nb = n / kLanes, lane = n % kLanes;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t step = k / 4;
      const uint8_t v = src[n * K + k];
      plo[((nb * (KS / 2) + step / 2) * kLanes + lane) * 4 + k % 4] |= static_cast<uint8_t>((v & 0x0F) << (4 * (step % 2)));
      phi[((nb * (KS / 4) + step / 4) * kLanes + lane) * 4 + k % 4] |= static_cast<uint8_t>((v >> 4) << (2 * (step % 4)));
    }
    for (int64_t j = 0; j < K / kHalf; ++j)
      osc.data_ptr<int8_t>()[(nb * (K / kHalf) + j) * kLanes + lane] = sc.data_ptr<int8_t>()[n * (K / kHalf) + j];
    for (int64_t j = 0; j < K / kSuper; ++j)
      od.data_ptr<float>()[(nb * (K / kSuper) + j) * kLanes + lane] = d.data_ptr<float>()[n * (K / kSuper) + j];
  }
  return {lo, hi, osc, od};
}

// Rows `ids` of packed Q6_K weights as float32 (d * sc) * (q - 32), ggml's values: an
// embedding table read from the tied LM head's packed copy.
at::Tensor q6k_rows(at::Tensor ids, at::Tensor lo, at::Tensor hi, at::Tensor d, at::Tensor sc, int64_t K) {
  const int64_t NB = d.size(0), KS = K / 4;
  check_packed(lo, hi, d, sc, NB, K);
  const uint8_t* plo = lo.data_ptr<uint8_t>();
  const uint8_t* phi = hi.data_ptr<uint8_t>();
  const int8_t* psc = sc.data_ptr<int8_t>();
  const float* pd = d.data_ptr<float>();
  return gather_rows(ids, NB * kLanes, K, d.options(), [&](int64_t n, int64_t k) {
    const int64_t nb = n / kLanes, lane = n % kLanes, step = k / 4;
    const int q = ((plo[((nb * (KS / 2) + step / 2) * kLanes + lane) * 4 + k % 4] >> (4 * (step % 2))) & 0x0F) |
                  (((phi[((nb * (KS / 4) + step / 4) * kLanes + lane) * 4 + k % 4] >> (2 * (step % 4))) & 3) << 4);
    const float dsc = pd[(nb * (K / kSuper) + k / kSuper) * kLanes + lane] *
                      static_cast<float>(psc[(nb * (K / kHalf) + k / kHalf) * kLanes + lane]);
    return dsc * static_cast<float>(q - 32);
  });
}

at::Tensor linear_q6k_rows(const W8A8Rows& x, at::Tensor lo, at::Tensor hi, at::Tensor d, at::Tensor sc, int64_t N,
                           c10::optional<at::Tensor> bias, bool out_float32) {
  const int64_t M = x.q.size(0), Kp = x.q.size(1), NB = (N + kLanes - 1) / kLanes;
  check_packed(lo, hi, d, sc, NB, Kp);
  TORCH_CHECK(x.K == Kp, "Q6_K rows are whole super-blocks of 256");
  const auto bias_f = float_or_empty(bias);
  auto out = at::empty({M, N}, x.q.options().dtype(out_float32 ? at::kFloat : at::kBFloat16));
  if (M == 0) return out;
  // Each half-block's sum(qx), for the -32 offset (one pass over the activations).
  auto hsums = at::empty({M, Kp / kHalf}, x.q.options().dtype(at::kInt));
  const int8_t* xq = x.q.data_ptr<int8_t>();
  int32_t* hs = hsums.data_ptr<int32_t>();
  for (int64_t i = 0; i < M * (Kp / kHalf); ++i) {
    int32_t s = 0;
    for (int j = 0; j < kHalf; ++j) s += xq[i * kHalf + j];
    hs[i] = s;
  }
  const Q6Weights w{lo.data_ptr<uint8_t>(), hi.data_ptr<uint8_t>(), sc.data_ptr<int8_t>(), d.data_ptr<float>(),
                    Kp / 4};
  const Q6Acts acts{xq, x.scales.data_ptr<float>(), hs, Kp};
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  void* op = out.data_ptr();
  // The low nibbles are most of a panel's bytes: their next panel is what is prefetched.
  for_panels(M, NB, kCols, kRows, w.lo, w.KS / 2 * kLanes * 4, Kp / kBlock,
             [&](int64_t nb0, int C, int64_t m0, int r, Prefetch pf) {
               switch (r) {
                 case 1: return block_cols<1>(C, w, acts, nb0, bp, N, out_float32, op, m0, pf);
                 case 2: return block_cols<2>(C, w, acts, nb0, bp, N, out_float32, op, m0, pf);
                 default: return block_cols<kRows>(C, w, acts, nb0, bp, N, out_float32, op, m0, pf);
               }
             });
  return out;
}

}  // namespace sluice
