// The Python module of the CPU kernels (backends/cpu/x86/__init__.py loads it): every entry
// point, with its arguments' names and defaults. The one file that includes torch's
// pybind11 headers (aten.h says why): the tensor type casters and the STL ones (optional
// arguments), not all of <torch/extension.h>, whose C++ frontend (torch/all.h) doubled
// this file's compile (35 -> 16 s alone, in each of the three builds). aten.h first, as in
// every file: its precompiled form (x86/__init__.py) serves only a file's first include.
#include "aten.h"

#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "decoder_stack.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // paged_attention.cpp
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("paged_attention_varlen", &paged_attention_varlen,
        "attention for every token of a flat batch over a paged KV cache, prefill and decode alike (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("window") = 0);

  // batch_invariant.cpp
  m.attr("has_batch_invariant") = true;
  m.def("bi_pack_weight", &sluice::pack_weight, "pack [N, K] weights for bi_linear");
  m.def("bi_packed_rows", &sluice::packed_rows, "rows of a bf16 weight packed by bi_pack_weight");
  m.def("bi_linear", &sluice::linear, "batch-invariant x @ W^T (+ b)", py::arg("x"), py::arg("packed"),
        py::arg("n"), py::arg("bias") = py::none(), py::arg("out_float32") = false);
  m.def("bi_pack_weight_int8", &sluice::pack_weight_int8, "pack [N, K] int8 weights for bi_linear_int8");
  m.def("bi_linear_int8", &sluice::linear_int8, "batch-invariant x @ (q * scale)^T (+ b), int8 weights",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("out_float32") = false);
  m.def("rope_write_kv", &sluice::rope_write_kv, "RoPE on q and k, K/V into the paged cache, q out");
  m.def("bi_rms_norm", &sluice::rms_norm, "batch-invariant RMSNorm over the last dim");
  m.def("bi_add_rms_norm", &sluice::add_rms_norm, "(RMSNorm(x + residual), x + residual), batch-invariant");
  m.def("bi_silu_and_mul", &sluice::silu_and_mul, "batch-invariant silu(gate) * up");

  // lora.cpp
  m.def("lora_sgmv", &sluice::lora_sgmv,
        "y[t] += B[s] @ round(A[s] @ x[t]) for each row t with slot s = row_slot[t] >= 0 (LoRA adapters)",
        py::arg("y"), py::arg("x"), py::arg("at"), py::arg("bt"), py::arg("ranks"), py::arg("row_slot"));

  // decoder_stack.h. Module-local: each ISA's build is its own module with its own class of
  // the same C++ name, and a process may load two (the tests compare them).
  py::class_<sluice::DecoderStack>(m, "DecoderStack", py::module_local())
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("scale"), py::arg("eps"), py::arg("final_norm"))
      .def("add_layer", &sluice::DecoderStack::add_layer)
      .def("set_lora", &sluice::DecoderStack::set_lora)
      .def("forward", &sluice::DecoderStack::forward)
      .def("set_profile", &sluice::DecoderStack::set_profile, "time each kind of call of the layers (profile())")
      .def("profile", &sluice::DecoderStack::profile, "(kinds, seconds per kind, forward calls) since the last reset")
      .def("reset_profile", &sluice::DecoderStack::reset_profile);

  // w8a8.cpp
  m.attr("has_w8a8") = true;
  m.def("w8a8_pack_weight", &sluice::w8a8_pack_weight, "pack [N, K] int8 weights for w8a8_linear");
  m.def("w8a8_linear", &sluice::linear_w8a8, "x @ (q * scale)^T (+ b), x quantized to int8 per block of 32",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("out_float32") = false);

  // head_w8a7.cpp
  m.def("head_w8a7_pack", &sluice::head_w8a7_pack, "pack [N, K] int8 weights as q + 128 for head_w8a7");
  m.def("head_w8a7", &sluice::head_w8a7,
        "approximate LM head logits: int8 weights packed as q + 128 by activations quantized to 7 bits per block of 32",
        py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("n"));
  // w4a8.cpp
  m.def("w4a8_pack_weight", &sluice::w4a8_pack_weight,
        "pack [N, K] 4-bit weights (0..15; wide: 0..254, packed as int8) and their [N, K/32] block scales "
        "and minimums for w4a8_linear");
  m.def("w4a8_rows", &sluice::w4a8_rows, "rows ids of packed block weights as float32 q * d + m",
        py::arg("ids"), py::arg("packed"), py::arg("d"), py::arg("m"), py::arg("k"), py::arg("nibbles") = py::none());
  m.def("w4a8_pack_5bit", &sluice::w4a8_pack_5bit,
        "pack [N, K] weights in 0..31 at 5 bits a weight (nibbles and a plane of fifth bits) with their block "
        "scales and minimums (or one -offset per row) for w4a8_linear");
  m.def("w4a8_pack_nibbles", &sluice::w4a8_pack_nibbles,
        "the packed 4-bit weights two to a byte, which w4a8_linear reads for steps of few rows");
  m.def("w4a8_half_scales", &sluice::w4a8_half_scales,
        "w4a8_pack_weight's block scales and minimums as float16 where all are float16 values, else None");
  m.def("w4a8_nibble_max_rows", &sluice::w4a8_nibble_max_rows,
        "the most rows a step may have for w4a8_linear to read the nibbles (this build's choice)");
  m.def("w4a8_linear", &sluice::linear_w4a8,
        "x @ (q * d + m)^T (+ b), 4-bit weights per block of 32, x quantized to int8 per block of 32",
        py::arg("x"), py::arg("packed"), py::arg("d"), py::arg("m"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("out_float32") = false, py::arg("nibbles") = py::none(),
        py::arg("nibble_scales") = py::none());
  // q6k.cpp (its linear layer and rows run through w4a8_linear and w4a8_rows)
  m.def("q6k_pack_weight", &sluice::q6k_pack_weight,
        "pack [N, K] Q6_K weights (q in 0..63, [N, K/16] int8 scales, [N, K/256] float32 scales) as (low nibbles, "
        "top bits, scales, d) for w4a8_linear (packed, nibbles, m, d)");

  // cpu_cache.cpp
  m.def("install_cpu_cache", &sluice::install_cpu_cache,
        "torch's CPU tensors of up to 64 KB from size-class free lists (once per process); whether this call did it");
  m.def("cpu_cache_bytes", &sluice::cpu_cache_bytes, "bytes the CPU tensor cache holds in free blocks");
  m.def("trim_cpu_cache", &sluice::trim_cpu_cache, "free every block the CPU tensor cache holds");

  // argmax.cpp
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "structured outputs: logits[rows[r]] = -inf where bitmask[r] has a 0 bit, in place");
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) for [B, V] float32, rows over threads");
  m.def("greedy_head", &greedy_head, "argmax of the bf16 LM head from int8 logits: the top k rescored exactly",
        py::arg("approx"), py::arg("x"), py::arg("packed"), py::arg("k") = 16);

  // sample.cpp
  m.def("sample_rows", &sample_rows,
        "one token per row of float32 logits: temperature (0: argmax), top-k, top-p, min-p, inverse CDF at u",
        py::arg("logits"), py::arg("temperature"), py::arg("u"), py::arg("top_k") = py::none(),
        py::arg("top_p") = py::none(), py::arg("min_p") = py::none());
}
