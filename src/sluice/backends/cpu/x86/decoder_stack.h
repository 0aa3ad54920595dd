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

#include <array>
#include <chrono>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "team.h"

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
  c10::optional<at::Tensor> w4nib_scales;  // ... with their own float16 d and m (AVX2 builds)
  // LoRA adapters' resident slots of this layer (lora/slots.py LoRALayer: A^T, B^T stacks
  // and each slot's rank), undefined where none are served.
  at::Tensor lora_at, lora_bt, lora_ranks;

  // y += each row's adapter delta (lora.cpp), for a step with LoRA rows.
  void add_lora(at::Tensor& y, const at::Tensor& x, const c10::optional<at::Tensor>& row_slot) const {
    if (row_slot && lora_at.defined()) sluice::lora_sgmv(y, x, lora_at, lora_bt, lora_ranks, *row_slot);
  }

  // Whether the layer takes int8-quantized rows (W8A8Rows).
  bool quantized() const { return w8a8.defined() || w4a8.defined(); }

  // x @ W^T into out ([T, n] bf16); a layer that takes int8 rows quantizes x into xq
  // first (linear_w4a8 and linear_w8a8 do the same).
  void into(const at::Tensor& x, sluice::W8A8Rows& xq, at::Tensor& out) const {
    if (quantized()) {
      sluice::w8a8_quantize_into(x, xq);
      into(xq, out);
    } else if (q_packed.defined() && static_cast<double>(x.size(0)) <= int8_max_rows) {
      out = sluice::linear_int8(x, q_packed, qscale, n, bias, false);
    } else {
      sluice::linear_into(x, packed, n, bias, out);
    }
  }
  void into(const sluice::W8A8Rows& x, at::Tensor& out) const {
    if (w4a8.defined()) sluice::linear_w4a8_rows_into(x, w4a8, w4d, w4m, n, bias, w4nib, out, w4nib_scales);
    else sluice::linear_w8a8_rows_into(x, w8a8, qscale, n, bias, out);
  }
};

struct StackLayer {
  StackLinear qkv, o, gate_up, down;
  at::Tensor input_norm, post_attention_norm;
};

class DecoderStack {
 public:
  // What a step's layers spend their time on (benchmarks/step_profile.py): the master
  // thread's wall time per kind of call, summed over the layers and the steps since the
  // last reset, while profiling is on. A linear call's time includes quantizing its
  // activations where it does so itself, and waiting for the other threads' shares.
  static constexpr std::array<const char*, 8> kProfileKinds = {
      "qkv", "rope_write_kv", "attention", "o", "add_rms_norm", "gate_up", "silu_and_mul", "down"};

  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale, double eps,
               at::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        final_norm_(final_norm.contiguous()) {}

  // Each linear: (n, packed, q_packed, qscale, int8_max_rows, bias, w8a8, w4a8, w4d, w4m,
  // w4nib); absent tensors are None.
  using LinearArgs = std::tuple<int64_t, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, double, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                                c10::optional<at::Tensor>, c10::optional<at::Tensor>, c10::optional<at::Tensor>>;

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

  // Profiling: time each kind of call while on (kProfileKinds).
  void set_profile(bool on) { profile_ = on; }
  // Seconds per kind (kProfileKinds' order) and the number of forward calls profiled.
  std::tuple<std::vector<std::string>, std::vector<double>, int64_t> profile() const {
    std::vector<std::string> names(kProfileKinds.begin(), kProfileKinds.end());
    std::vector<double> seconds(spent_.begin(), spent_.end());
    return {names, seconds, profiled_calls_};
  }
  void reset_profile() { spent_.fill(0.0), profiled_calls_ = 0; }

  // x: [T, hidden] embeddings; cos/sin: [T, 1, D]; one (k, v) cache pair per layer;
  // row_slot: each row's LoRA slot (-1: none) in a step with adapters, else None.
  // Returns the final norm's output, as LlamaForCausalLM.forward does.
  // The layers run in one thread team (team.h): one fork for the step, not one per
  // kernel call.
  at::Tensor forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                     const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                     at::Tensor slot_mapping, at::Tensor block_tables, at::Tensor query_start,
                     at::Tensor seq_lens, c10::optional<at::Tensor> row_slot) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache pair per layer");
    if (profile_) ++profiled_calls_;
    at::Tensor out;
    Team::run(at::get_num_threads(), [&] {
      out = layers(x, cos, sin, kv_caches, slot_mapping, block_tables, query_start, seq_lens, row_slot);
    });
    return out;
  }

 private:
  // A step's activations, made once for all its layers: a one-row step's ~25 small
  // tensors a layer cost about what its norms, RoPE and attention compute.
  struct Buffers {
    at::Tensor residual, h, qkv, q, attn, o, gate_up, act, mlp;
    sluice::W8A8Rows hidden_q, heads_q, act_q;  // int8 rows of the hidden size, q_size, intermediate
  };

  at::Tensor layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                    const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& query_start,
                    const at::Tensor& seq_lens, const c10::optional<at::Tensor>& row_slot) const {
    TORCH_CHECK(x.dim() == 2, "x must be [T, hidden]");
    const int64_t T = x.size(0), H = x.size(1), q_size = num_heads_ * head_dim_;
    const auto opts = x.options();
    Buffers b;
    b.residual = at::empty({T, H}, opts);
    b.h = at::empty({T, H}, opts);
    b.q = at::empty({T, num_heads_, head_dim_}, opts);
    b.attn = at::empty({T, num_heads_, head_dim_}, opts);
    b.o = at::empty({T, H}, opts);
    b.mlp = at::empty({T, H}, opts);
    b.hidden_q = sluice::w8a8_rows(T, H, opts);
    b.heads_q = sluice::w8a8_rows(T, q_size, opts);
    const at::Tensor cos2 = cos.reshape({T, head_dim_}).contiguous(), sin2 = sin.reshape({T, head_dim_}).contiguous();
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const AttentionPlan plan = attention_plan(block_tables, query_start, seq_lens, T);
    const at::Tensor heads = b.attn.view({T, q_size});

    // The residual stream starts as x (the caller's, never written) and lives in
    // b.residual from the first norm on.
    const at::Tensor* residual = &x;
    at::Tensor h = sluice::rms_norm(x, layers_[0].input_norm, eps_);
    // A norm or SwiGLU whose output feeds a w8a8 layer quantizes its rows as it makes
    // them (the same bits as quantizing its bf16 output in the linear layer). Not in a step
    // with LoRA rows: the adapters' products take the bf16 rows the linear layers do.
    const bool lora = row_slot.has_value();
    bool quantized = false;  // whether this layer's input is b.hidden_q (else h)
    Clock clock{profile_, spent_};
    for (size_t i = 0; i < layers_.size(); ++i) {
      const StackLayer& l = layers_[i];
      const auto& [k_cache, v_cache] = kv_caches[i];
      sized(b.qkv, T, l.qkv.n, opts);
      if (quantized) l.qkv.into(b.hidden_q, b.qkv);
      else l.qkv.into(h, b.hidden_q, b.qkv);
      l.qkv.add_lora(b.qkv, h, row_slot);
      clock.mark(0);
      sluice::rope_write_kv_into(b.qkv, cos2, sin2, k_cache, v_cache, slots, num_heads_, num_kv_heads_, b.q);
      clock.mark(1);
      paged_attention_into(b.q, k_cache, v_cache, plan, scale_, 0, b.attn);
      clock.mark(2);
      l.o.into(heads, b.heads_q, b.o);
      l.o.add_lora(b.o, heads, row_slot);
      clock.mark(3);
      sized(b.gate_up, T, l.gate_up.n, opts);
      if (l.gate_up.quantized() && !lora) {
        sluice::add_rms_norm_w8a8_into(b.o, *residual, l.post_attention_norm, eps_, b.hidden_q, b.residual);
        clock.mark(4);
        l.gate_up.into(b.hidden_q, b.gate_up);
      } else {
        sluice::add_rms_norm_into(b.o, *residual, l.post_attention_norm, eps_, b.h, b.residual);
        clock.mark(4);
        h = b.h;
        l.gate_up.into(h, b.hidden_q, b.gate_up);
        l.gate_up.add_lora(b.gate_up, h, row_slot);
      }
      clock.mark(5);
      residual = &b.residual;
      const int64_t inter = l.gate_up.n / 2;
      if (!b.act_q.q.defined() || b.act_q.K != inter) b.act_q = sluice::w8a8_rows(T, inter, opts);
      if (l.down.quantized() && !lora) {
        sluice::silu_and_mul_w8a8_into(b.gate_up, b.act_q);
        clock.mark(6);
        l.down.into(b.act_q, b.mlp);
      } else {
        sized(b.act, T, inter, opts);
        sluice::silu_and_mul_into(b.gate_up, b.act);
        clock.mark(6);
        l.down.into(b.act, b.act_q, b.mlp);
        l.down.add_lora(b.mlp, b.act, row_slot);
      }
      clock.mark(7);
      const bool last = i + 1 == layers_.size();
      const at::Tensor& next_norm = last ? final_norm_ : layers_[i + 1].input_norm;
      quantized = !last && layers_[i + 1].qkv.quantized() && !lora;
      if (quantized) {
        sluice::add_rms_norm_w8a8_into(b.mlp, b.residual, next_norm, eps_, b.hidden_q, b.residual);
      } else {
        sluice::add_rms_norm_into(b.mlp, b.residual, next_norm, eps_, b.h, b.residual);
        h = b.h;
      }
      clock.mark(4);
    }
    return h;
  }

  // Time since the last mark, added to a kind's total (a branch when profiling is off).
  struct Clock {
    bool on;
    std::array<double, kProfileKinds.size()>& spent;
    std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now()
                                                    : std::chrono::steady_clock::time_point{};
    void mark(size_t kind) {
      if (!on) return;
      const auto now = std::chrono::steady_clock::now();
      spent[kind] += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };

  // t as a [rows, cols] tensor: kept where it already is one.
  static void sized(at::Tensor& t, int64_t rows, int64_t cols, const at::TensorOptions& opts) {
    if (!t.defined() || t.size(0) != rows || t.size(1) != cols) t = at::empty({rows, cols}, opts);
  }

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
    s.w4nib_scales = std::get<11>(a);
    TORCH_CHECK(s.packed.defined() || s.q_packed.defined() || s.w8a8.defined() || s.w4a8.defined(),
                "a linear layer needs packed weights");
    return s;
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  // Profiling (set_profile): mutable since forward is const; the engine thread alone
  // runs forward and reads or resets the totals between steps.
  bool profile_ = false;
  mutable std::array<double, kProfileKinds.size()> spent_{};
  mutable int64_t profiled_calls_ = 0;
  at::Tensor final_norm_;
  std::vector<StackLayer> layers_;
};

}  // namespace sluice
