// The entry points of the CPU kernels that other kernel files call directly (the
// decoder stack chains them without going back to Python between ops).
#pragma once

#include <torch/extension.h>

#include <tuple>

torch::Tensor paged_attention_varlen(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor query_start,
                                     torch::Tensor seq_lens, double scale);

namespace sluice {
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     bool out_float32);
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                          c10::optional<torch::Tensor> bias, bool out_float32);
// A bias (or nothing) as contiguous float32, undefined when absent.
torch::Tensor float_or_empty(const c10::optional<torch::Tensor>& t);
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                          c10::optional<torch::Tensor> bias, bool out_float32);
// Activations as linear_w8a8 quantizes them (w8a8.cpp): [M, K padded to 32] int8, one
// scale per block of 32, and each row's correction for the +128 weight offset. The AVX2
// build also keeps |q| and 128 * each block's sum of q (qabs, boff: its dot products'
// operands, made once per row); the AVX-512 build leaves them undefined.
struct W8A8Rows {
  torch::Tensor q, scales, corr;
  int64_t K = 0;
  torch::Tensor qabs, boff;
};
W8A8Rows w8a8_rows(int64_t M, int64_t K, const torch::TensorOptions& options);
// Quantizes one bf16 row of K values into row r.
void w8a8_quantize_row(const uint16_t* x, W8A8Rows& rows, int64_t r);
torch::Tensor linear_w8a8_rows(const W8A8Rows& x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                               c10::optional<torch::Tensor> bias, bool out_float32);
// add_rms_norm and silu_and_mul (bf16) whose output rows go straight to w8a8_quantize_row:
// the same bits as quantizing their bf16 outputs, in one pass.
std::tuple<W8A8Rows, torch::Tensor> add_rms_norm_w8a8(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);
W8A8Rows silu_and_mul_w8a8(torch::Tensor gate_up);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads);
}  // namespace sluice
