// The entry points of the CPU kernels that other kernel files call directly (the
// decoder stack chains them without going back to Python between ops).
#pragma once

#include <torch/extension.h>

#include <tuple>

torch::Tensor paged_attention_varlen(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor query_start,
                                     torch::Tensor seq_lens, double scale);

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace sluice {
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, c10::optional<torch::Tensor> bias,
                     bool out_float32);
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                          c10::optional<torch::Tensor> bias, bool out_float32);
// A bias (or nothing) as contiguous float32, undefined when absent.
torch::Tensor float_or_empty(const c10::optional<torch::Tensor>& t);
torch::Tensor linear_w8a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t N,
                          c10::optional<torch::Tensor> bias, bool out_float32);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                                                      double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor rope_write_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping, int64_t num_heads,
                            int64_t num_kv_heads);
}  // namespace sluice
#endif
