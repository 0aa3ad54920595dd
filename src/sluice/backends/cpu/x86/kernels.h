// The entry points of the CPU kernels: those bindings.cpp gives Python, and those other
// kernel files call directly (the decoder stack chains them without going back to Python
// between ops).
#pragma once

#include "aten.h"

#include <tuple>
#include <vector>

// paged_attention.cpp
at::Tensor paged_attention_varlen(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor query_start,
                                  at::Tensor seq_lens, double scale, int64_t window = 0);
// What attention needs to know of a step's batch, the same for every layer: made once a
// step by the decoder stack instead of once per layer.
struct AttentionPlan {
  at::Tensor bt, qs, lens;                // block tables, query starts, context lengths (int64)
  std::vector<int64_t> tok_req, tok_len;  // each token's request (-1: padding) and context length
};
AttentionPlan attention_plan(const at::Tensor& block_tables, const at::Tensor& query_start, const at::Tensor& seq_lens,
                             int64_t T);
void check_attention_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t window);
void paged_attention_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const AttentionPlan& plan, double scale, int64_t window, at::Tensor& out);
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                                  at::Tensor seq_lens, double scale);
// argmax.cpp
at::Tensor greedy_head(at::Tensor approx, at::Tensor x, at::Tensor packed, int64_t k);
at::Tensor argmax_rows(at::Tensor logits);
void apply_token_bitmask(at::Tensor logits, at::Tensor bitmask, at::Tensor rows);
// sample.cpp
at::Tensor sample_rows(at::Tensor logits, at::Tensor temperature, at::Tensor u, c10::optional<at::Tensor> top_k,
                       c10::optional<at::Tensor> top_p, c10::optional<at::Tensor> min_p);

namespace sluice {
// argmax.cpp: torch.argmax over one float32 row.
int64_t argmax_row(const float* x, int64_t n);
// cpu_cache.cpp: torch's small CPU tensors from free lists (installed once per process).
bool install_cpu_cache();
int64_t cpu_cache_bytes();
void trim_cpu_cache();
// lora.cpp: each row's LoRA delta through its own adapter slot, added to y in place.
void lora_sgmv(at::Tensor y, at::Tensor x, at::Tensor at_, at::Tensor bt, at::Tensor ranks, at::Tensor row_slot);
// batch_invariant.cpp and w8a8.cpp: weights packed once at load for their linear kernels.
at::Tensor pack_weight(at::Tensor w);
at::Tensor packed_rows(at::Tensor ids, at::Tensor packed, int64_t N, int64_t K);
at::Tensor pack_weight_int8(at::Tensor q);
at::Tensor w8a8_pack_weight(at::Tensor q);
at::Tensor linear(at::Tensor x, at::Tensor packed, int64_t N, c10::optional<at::Tensor> bias,
                  bool out_float32);
void linear_into(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias,
                 at::Tensor& out);
at::Tensor linear_int8(at::Tensor x, at::Tensor packed, at::Tensor scale, int64_t N,
                       c10::optional<at::Tensor> bias, bool out_float32);
// A bias (or nothing) as contiguous float32, undefined when absent.
at::Tensor float_or_empty(const c10::optional<at::Tensor>& t);
at::Tensor linear_w8a8(at::Tensor x, at::Tensor packed, at::Tensor scale, int64_t N,
                       c10::optional<at::Tensor> bias, bool out_float32);
// Activations as linear_w8a8 quantizes them (w8a8.cpp): [M, K padded to 32] int8, one
// scale per block of 32, and each row's correction for the +128 weight offset. The AVX2
// build also keeps |q| and 128 * each block's sum of q (qabs, boff: its dot products'
// operands, made once per row); the AVX-512 build leaves them undefined. bsums: each
// block's scale times its sum of q (what w4a8's block minimums multiply).
struct W8A8Rows {
  at::Tensor q, scales, corr;
  int64_t K = 0;
  at::Tensor qabs, boff;
  at::Tensor bsums;
};
W8A8Rows w8a8_rows(int64_t M, int64_t K, const at::TensorOptions& options);
// Quantizes one bf16 row of K values into row r.
void w8a8_quantize_row(const uint16_t* x, W8A8Rows& rows, int64_t r);
// Every row of x ([M, K] bf16), rows over threads.
W8A8Rows w8a8_quantize(at::Tensor x);
void w8a8_quantize_into(const at::Tensor& x, W8A8Rows& rows);  // into rows made by w8a8_rows
at::Tensor linear_w8a8_rows(const W8A8Rows& x, at::Tensor packed, at::Tensor scale, int64_t N,
                            c10::optional<at::Tensor> bias, bool out_float32);
// The *_into entry points write a preallocated, contiguous output (the decoder stack's
// buffers for a step): the same bits as the allocating ones, without a tensor per call.
void linear_w8a8_rows_into(const W8A8Rows& x, const at::Tensor& packed, const at::Tensor& scale, int64_t N,
                           const c10::optional<at::Tensor>& bias, at::Tensor& out);
// w4a8.cpp: 4-bit weights (Q4_1's form: per block of 32, a scale and a minimum) by the
// same quantized activations.
// nibbles: the same weights two to a byte (w4a8_pack_nibbles), read by steps of few rows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_pack_weight(at::Tensor q, at::Tensor d, at::Tensor m);
at::Tensor w4a8_pack_nibbles(at::Tensor packed);
// Weights of up to 5 bits (a GGUF's Q5_0, Q5_1, Q5_K) at 5 bits a weight, in one tensor of
// five dimensions (the tag linear_w4a8_rows and w4a8_rows go by).
std::tuple<at::Tensor, at::Tensor, at::Tensor> w4a8_pack_5bit(at::Tensor q, at::Tensor d, at::Tensor m);
int64_t w4a8_nibble_max_rows();  // the most rows a step may have to read the nibbles
c10::optional<std::tuple<at::Tensor, at::Tensor>> w4a8_half_scales(at::Tensor d, at::Tensor m);
at::Tensor w4a8_rows(at::Tensor ids, at::Tensor packed, at::Tensor d, at::Tensor m, int64_t K,
                     c10::optional<at::Tensor> nibbles);
// nibble_scales: where the byte layout keeps float32 d and m, the nibbles' float16 copy of
// them ([2, ...]: d's, then m's; w4a8_half_scales stacked), read by steps on the nibbles.
at::Tensor linear_w4a8(at::Tensor x, at::Tensor packed, at::Tensor d, at::Tensor m, int64_t N,
                       c10::optional<at::Tensor> bias, bool out_float32,
                       c10::optional<at::Tensor> nibbles = c10::nullopt,
                       c10::optional<at::Tensor> nibble_scales = c10::nullopt);
at::Tensor linear_w4a8_rows(const W8A8Rows& x, at::Tensor packed, at::Tensor d, at::Tensor m, int64_t N,
                            c10::optional<at::Tensor> bias, bool out_float32,
                            c10::optional<at::Tensor> nibbles = c10::nullopt,
                            c10::optional<at::Tensor> nibble_scales = c10::nullopt);
void linear_w4a8_rows_into(const W8A8Rows& x, const at::Tensor& packed, const at::Tensor& d, const at::Tensor& m,
                           int64_t N, const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& nibbles,
                           at::Tensor& out, const c10::optional<at::Tensor>& nibble_scales = c10::nullopt);
// q6k.cpp: Q6_K weights in their own form (6-bit q, an int8 scale per 16 k, a float per
// 256 k) by the same quantized activations. The w4a8 entry points take them too, told
// apart by their int8 scales (KernelWeight: w4a8 = low nibbles, w4nib = top bits,
// w4d = d, w4m = sc).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> q6k_pack_weight(at::Tensor q, at::Tensor sc, at::Tensor d);
at::Tensor q6k_rows(at::Tensor ids, at::Tensor lo, at::Tensor hi, at::Tensor d, at::Tensor sc, int64_t K);
at::Tensor linear_q6k_rows(const W8A8Rows& x, at::Tensor lo, at::Tensor hi, at::Tensor d, at::Tensor sc, int64_t N,
                           c10::optional<at::Tensor> bias, bool out_float32);
// head_w8a7.cpp: the greedy fast path's approximate LM head without the sign trick.
at::Tensor head_w8a7_pack(at::Tensor q);
at::Tensor head_w8a7(at::Tensor x, at::Tensor packed, at::Tensor scale, int64_t N);
// add_rms_norm and silu_and_mul (bf16) whose output rows go straight to w8a8_quantize_row:
// the same bits as quantizing their bf16 outputs, in one pass.
std::tuple<W8A8Rows, at::Tensor> add_rms_norm_w8a8(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                   double eps);
W8A8Rows silu_and_mul_w8a8(at::Tensor gate_up);
// (sum may be residual itself)
void add_rms_norm_w8a8_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                            W8A8Rows& out, at::Tensor& sum);
void silu_and_mul_w8a8_into(const at::Tensor& gate_up, W8A8Rows& out);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight,
                                                double eps);
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& y, at::Tensor& sum);
at::Tensor silu_and_mul(at::Tensor gate_up);
void silu_and_mul_into(const at::Tensor& gate_up, at::Tensor& y);
at::Tensor rope_write_kv(at::Tensor qkv, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                         at::Tensor v_cache, at::Tensor slot_mapping, int64_t num_heads,
                         int64_t num_kv_heads);
// cos, sin [T, D] and slots int64, contiguous; q_out [T, num_heads, D].
void rope_write_kv_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                        const at::Tensor& v_cache, const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads,
                        at::Tensor& q_out);
}  // namespace sluice
