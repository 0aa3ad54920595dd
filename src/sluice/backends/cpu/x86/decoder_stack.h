// The decoder layers of a Llama-family model as one C++ call.
//
// Steps whose attention is one flat kernel call (worker/attention.py's
// flat_attention_kernel: decode-only steps, and every step in deterministic mode) run the
// same kernels as the Python forward, in the same order with the same arguments, so the
// bits are the same; only the ~10 Python -> C++ crossings per layer (module calls,
// argument conversion, result wrapping) are gone. At one row, where a step reads ~100 MB
// of int8 weights in ~5 ms, those crossings cost ~1.5 ms. One difference: with w8a8, a
// norm or SwiGLU that feeds a w8a8 layer quantizes each row as it makes it
// (add_rms_norm_w8a8, silu_and_mul_w8a8) instead of writing bf16 rows for the linear
// layer to quantize, which gives the same bits with one pass and one parallel region
// fewer (offline c32 decode steps 0.2-2.1 ms faster in six alternating pairs). The GIL
// stays held: releasing it let the HTTP thread compete with the OpenMP workers for the
// cores and cost throughput at 32 clients (measured again after the balanced linear
// kernels: 548 vs 572 tok/s, medians of three alternating pairs of 256 requests).
#pragma once

#include <tuple>
#include <vector>

#include "kernels.h"

namespace sluice {

// One linear layer as models/linear.py's KernelWeight holds it.
struct StackLinear {
  int64_t n = 0;
  at::Tensor packed;    // bf16/fp32 for sluice::linear; undefined when only int8 exists
  at::Tensor q_packed;  // int8 for sluice::linear_int8 ...
  at::Tensor qscale;    // ... with float32 per-column scales
  double int8_max_rows = 0;
  c10::optional<at::Tensor> bias;
  at::Tensor w8a8;      // for sluice::linear_w8a8 (with qscale), at every row count
  at::Tensor w4a8, w4d, w4m;  // for sluice::linear_w4a8, at every row count
  c10::optional<at::Tensor> w4nib;  // ... and its nibble-packed copy, for steps of few rows
  // LoRA adapters' resident slots of this layer (lora/slots.py LoRALayer: A^T, B^T stacks
  // and each slot's rank), undefined where none are served.
  at::Tensor lora_at, lora_bt, lora_ranks;

  // y += each row's adapter delta (lora.cpp), for a step with LoRA rows.
  void add_lora(at::Tensor& y, const at::Tensor& x, const c10::optional<at::Tensor>& row_slot) const {
    if (row_slot && lora_at.defined()) sluice::lora_sgmv(y, x, lora_at, lora_bt, lora_ranks, *row_slot);
  }

  // Whether the layer takes int8-quantized rows (W8A8Rows).
  bool quantized() const { return w8a8.defined() || w4a8.defined(); }

  at::Tensor operator()(const at::Tensor& x) const {
    if (w4a8.defined()) return sluice::linear_w4a8(x, w4a8, w4d, w4m, n, bias, false, w4nib);
    if (w8a8.defined()) return sluice::linear_w8a8(x, w8a8, qscale, n, bias, false);
    if (q_packed.defined() && static_cast<double>(x.size(0)) <= int8_max_rows)
      return sluice::linear_int8(x, q_packed, qscale, n, bias, false);
    return sluice::linear(x, packed, n, bias, false);
  }
  at::Tensor operator()(const sluice::W8A8Rows& x) const {
    if (w4a8.defined()) return sluice::linear_w4a8_rows(x, w4a8, w4d, w4m, n, bias, false, w4nib);
    return sluice::linear_w8a8_rows(x, w8a8, qscale, n, bias, false);
  }
};

struct StackLayer {
  StackLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_attention_norm;
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
               at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        final_norm_(final_norm.contiguous()) {}

  // Each linear: (n, packed, q_packed, qscale, int8_max_rows, bias, w8a8, w4a8, w4d, w4m,
  // w4nib); absent tensors are None.
  using LinearArgs = std::tuple<int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, double, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, c10::optional<at::Tensor>>;

  void add_layer(const LinearArgs& qkv, const LinearArgs& o, const LinearArgs& gate_up, const LinearArgs& down,
                 at::Tensor input_norm, at::Tensor post_attention_norm) {
    layers_.push_back({make(qkv), make(o), make(gate_up), make(down), input_norm.contiguous(),
                       post_attention_norm.contiguous()});
  }

  // Layer i's linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) gets LoRA slots (the tensors
  // are shared: slots loaded in place are seen; a stack that grows is set again).
  void set_lora(int64_t i, int64_t which, at::Tensor at_, at::Tensor bt, at::Tensor ranks) {
    TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers_.size()) && which >= 0 && which < 4, "no such linear");
    StackLayer& l = layers_[i];
    StackLinear& lin = which == 0 ? l.qkv : which == 1 ? l.o : which == 2 ? l.gate_up : l.down;
    lin.lora_at = at_, lin.lora_bt = bt, lin.lora_ranks = ranks;
  }

  // x: [T, hidden] embeddings; cos/sin: [T, 1, D]; one (k, v) cache pair per layer;
  // row_slot: each row's LoRA slot (-1: none) in a step with adapters, else None.
  // Returns the final norm's output, as LlamaForCausalLM.forward does.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                     const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                     at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor query_start,
                     at::Tensor seq_lens, c10::optional<at::Tensor> row_slot) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache pair per layer");
    const int64_t T = x.size(0), q_size = num_heads_ * head_dim_;
    at::Tensor residual = x;
    at::Tensor h = sluice::rms_norm(x, layers_[0].input_norm, eps_);
    // A norm or SwiGLU whose output feeds a w8a8 layer quantizes its rows as it makes
    // them (the same bits as quantizing its bf16 output in the linear layer). Not in a step
    // with LoRA rows: the adapters' products take the bf16 rows the linear layers do.
    const bool lora = row_slot.has_value();
    sluice::W8A8Rows hq;
    bool quantized = false;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      const auto& [k_cache, v_cache] = kv_caches[i];
      at::Tensor qkv = quantized ? l.qkv(hq) : l.qkv(h);
      l.qkv.add_lora(qkv, h, row_slot);
      at::Tensor q = sluice::rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads_, num_kv_heads_);
      at::Tensor attn = paged_attention_varlen(q, k_cache, v_cache, block_tables, query_start, seq_lens, scale_);
      at::Tensor heads = attn.reshape({T, q_size}).contiguous();
      attn = l.o(heads);
      l.o.add_lora(attn, heads, row_slot);
      at::Tensor gate_up;
      if (l.gate_up.quantized() && !lora) {
        sluice::W8A8Rows a;
        std::tie(a, residual) = sluice::add_rms_norm_w8a8(attn, residual, l.post_attention_norm, eps_);
        gate_up = l.gate_up(a);
      } else {
        std::tie(h, residual) = sluice::add_rms_norm(attn, residual, l.post_attention_norm, eps_);
        gate_up = l.gate_up(h);
        l.gate_up.add_lora(gate_up, h, row_slot);
      }
      at::Tensor mlp;
      if (l.down.quantized() && !lora) {
        mlp = l.down(sluice::silu_and_mul_w8a8(gate_up));
      } else {
        at::Tensor act = sluice::silu_and_mul(gate_up);
        mlp = l.down(act);
        l.down.add_lora(mlp, act, row_slot);
      }
      const bool last = i + 1 == layers_.size();
      const at::Tensor& next_norm = last ? final_norm_ : layers_[i + 1].input_norm;
      quantized = !last && layers_[i + 1].qkv.quantized() && !lora;
      if (quantized) std::tie(hq, residual) = sluice::add_rms_norm_w8a8(mlp, residual, next_norm, eps_);
      else std::tie(h, residual) = sluice::add_rms_norm(mlp, residual, next_norm, eps_);
    }
    return h;
  }

 private:
  static StackLinear make(const LinearArgs& a) {
    StackLinear s;
    s.n = std::get<0>(a);
    if (std::get<1>(a)) s.packed = *std::get<1>(a);
    if (std::get<2>(a)) s.q_packed = *std::get<2>(a);
    if (std::get<3>(a)) s.qscale = *std::get<3>(a);
    s.int8_max_rows = std::get<4>(a);
    s.bias = std::get<5>(a);
    if (std::get<6>(a)) s.w8a8 = *std::get<6>(a);
    if (std::get<7>(a)) s.w4a8 = *std::get<7>(a);
    if (std::get<8>(a)) s.w4d = *std::get<8>(a);
    if (std::get<9>(a)) s.w4m = *std::get<9>(a);
    s.w4nib = std::get<10>(a);
    TORCH_CHECK(s.packed.defined() || s.q_packed.defined() || s.w8a8.defined() || s.w4a8.defined(),
                "a linear layer needs packed weights");
    return s;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  at::Tensor final_norm_;
  std::vector<StackLayer> layers_;
};

}  // namespace sluice
