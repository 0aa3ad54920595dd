"""Sets a loaded model up as the backend plan says (backends/select.py decides; this
module carries it out): quantizes its weights, gives each Linear its method, the norms,
SwiGLU and RoPE their ops, and builds the LM head and the fast paths our kernels have
(the greedy head, the whole decoder stack in one C++ call). After a weight update,
`update` does the same for what the new weights touch, so the model computes what a
fresh load of the new weights would. It knows the decoder layout
of models/llama.py (the Llama family); the model itself never looks at the hardware.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sluice.backends.linear_methods import (ROW_QUANTIZERS, Int8Weight, PackedWeight, int8_weight, kernel_weight,
                                            prepack_weight, quantize_per_channel)
from sluice.backends.ops import KernelOps
from sluice.config import QUANTIZATIONS
from sluice.models.linear import Linear

# Tokens per row that the greedy fast path rescores exactly (GreedyHead).
GREEDY_CANDIDATES = 16


@dataclass
class GreedyHead:
    """The argmax of the bf16 LM head per row, fast: an approximate head runs first and its
    GREEDY_CANDIDATES best tokens per row are rescored with the bf16 head's own arithmetic
    (the same bits); the best of those is the answer. The approximate head has per-row
    int8 weights times activations quantized per block of 32: to int8 (w8a8_linear, ~0.6x
    the bf16 head's time at 32 rows, ~0.3x at one), or on the plain AVX2 build to 7 bits
    (head_w8a7, without the sign trick: ~0.7x w8a8's time from 8 rows). That is the full
    head's argmax unless the approximation pushed the true best below GREEDY_CANDIDATES
    others: over ~8,000 greedy steps of the default model it ranked at most 2nd with
    either activations (docs/lab-notes.md, session 37)."""
    kernels: object
    packed_int8: torch.Tensor  # the head's int8 weights, packed for w8a8_linear or head_w8a7
    scale: torch.Tensor        # their per-row scales
    packed: torch.Tensor       # the bf16 head, packed for bi_linear
    vocab_size: int
    seven_bit: bool = False    # head_w8a7 rather than w8a8_linear

    def __call__(self, hidden: torch.Tensor, grammar=None) -> torch.Tensor:
        """grammar: (rows, token bitmasks) of structured outputs: those rows' approximate
        logits are masked before the candidates are picked, so their argmax is over the
        tokens the grammar allows (the kernel never answers a masked candidate)."""
        k = self.kernels
        if self.seven_bit:
            approx = k.head_w8a7(hidden, self.packed_int8, self.scale, self.vocab_size)
        else:
            approx = k.w8a8_linear(hidden, self.packed_int8, self.scale, self.vocab_size, None, True)
        if grammar is not None:
            k.apply_token_bitmask(approx, grammar[1], grammar[0])
        return k.greedy_head(approx, hidden, self.packed, GREEDY_CANDIDATES)


def _linears(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


@torch.no_grad()
def prepare(model, plan, quantization: str | None = None, max_positions: int | None = None,
            with_head: bool = True) -> None:
    """Quantize if asked, then run every linear layer, RMSNorm, SwiGLU and RoPE through the
    plan's kernels, or prepack the weights for oneDNN. Deterministic mode also fixes the
    RoPE values. with_head=False: no LM head (a tensor-parallel rank other than 0, which
    never computes logits)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None, 'int8', 'w8a8' or 'w4a8', got {quantization!r}")
    for name, module in _linears(model):
        if quantization is not None:  # int8 and w8a8: the same int8 weights
            ROW_QUANTIZERS[quantization](module)
        module.method = _linear_method(model, name, module, plan, quantization)
    _finish(model, plan, quantization, max_positions, with_head)


@torch.no_grad()
def update(model, plan, quantization: str | None, written: dict[str, list[tuple[int, int]]],
           with_head: bool = True) -> None:
    """After a weight update wrote new checkpoint values into some parameters (`written`:
    parameter name -> its (first row, rows) ranges, as model.load_weights returns): quantize
    the new rows by the same method as at load, rebuild the methods of the layers they
    belong to and every fast path that holds weights. The result is what prepare() makes
    of a fresh load of the new weights."""
    modules = dict(model.named_modules())
    changed: dict[str, Linear] = {}
    for pname, ranges in written.items():
        owner, _, kind = pname.rpartition(".")
        module = modules.get(owner)
        if isinstance(module, Linear):
            if quantization is not None and kind == "weight":
                for start, rows in ranges:
                    ROW_QUANTIZERS[quantization](module, start, rows)
            changed[owner] = module
    for name, module in changed.items():
        module.method = _linear_method(model, name, module, plan, quantization)
    _finish(model, plan, quantization, None, with_head)


def _linear_method(model, name: str, module: Linear, plan, quantization: str | None):
    """A Linear's method under the plan, from its weight (dequantized when quantized)."""
    q = int8_weight(module, plan.dtype) if quantization in ("int8", "w8a8") else None
    k = plan.model_kernels
    if k is not None:
        # w8a8 everywhere but the LM head and the first and last decoder layers, which keep
        # bf16 activations: on SmolLM2 int8 activations in the head took the KL divergence
        # from float32 from 0.006 to 0.009, and in the two end layers from 0.0054 to 0.0063
        # (and flipped the answer to "What is the capital of France?"), for ~1% of the speed.
        last = len(model.model.layers) - 1
        ends = ("lm_head", "model.layers.0.", f"model.layers.{last}.")
        w8a8 = plan.linear == "kernels-w8a8" and not name.startswith(ends)
        # w4a8 likewise; its end layers multiply the 4-bit weights' values in bf16.
        w4 = module.w4 if plan.linear == "kernels-w4a8" and not name.startswith(ends) else None
        method = kernel_weight(k, module.weight, q, plan.deterministic, w8a8, w4)
        # Row-parallel: each rank's partial sums stay float32 through the all-reduce and are
        # rounded once (Linear.forward), as one process rounds its whole sum (the tiny
        # model's logprobs: one process's to the bit, none of them when each rank rounded
        # its share; docs/design.md, "Tensor parallelism").
        return dataclasses.replace(method, out_float32=True) if module.reduce is not None else method
    packed = PackedWeight(prepack_weight(module.weight)) if plan.linear.endswith("onednn-bf16") else None
    if q is not None:
        return Int8Weight(q[0], q[1], module.weight.detach(), packed)
    return packed


def _finish(model, plan, quantization: str | None, max_positions: int | None, with_head: bool) -> None:
    """What holds more than one layer's weights: the LM head, the greedy head, the decoder
    stack; and the ops and RoPE table of the kernels."""
    int8_head = None
    if quantization is not None and model.lm_head is None and with_head:
        # Tied head: an int8 copy for the head; the embedding table stays as loaded.
        q, scale = quantize_per_channel(model.model.embed_tokens.weight)
        int8_head = (q, scale.to(plan.dtype))
    k = plan.model_kernels
    if k is None:
        if not with_head:
            return
        if model.lm_head is not None:
            model.head = model.lm_head
            return
        # Tied head: a packed copy beside the embedding table, and/or its int8 copy.
        emb = model.model.embed_tokens.weight.detach()
        packed = PackedWeight(prepack_weight(emb)) if plan.linear.endswith("onednn-bf16") else None
        model.head = Int8Weight(*int8_head, emb, packed) if int8_head is not None else packed
        return
    if with_head:
        if model.lm_head is None:  # tied head: its own packed copy of the embedding table
            head = kernel_weight(k, model.model.embed_tokens.weight, int8_head, plan.deterministic)
        else:
            head = model.lm_head.method
        model.head = dataclasses.replace(head, out_float32=True)  # float32 logits
        if plan.head.startswith("kernels-greedy-") and head.packed is not None:
            # The same weight the bf16 head multiplies by, in int8 for the greedy fast path.
            q, scale = quantize_per_channel(model.head_weight())
            seven_bit = plan.head == "kernels-greedy-w8a7"
            packed_int8 = k.head_w8a7_pack(q) if seven_bit else k.w8a8_pack_weight(q)
            model._greedy_head = GreedyHead(k, packed_int8, scale.float().contiguous(), head.packed,
                                            model.arch.vocab_size, seven_bit)
    ops = KernelOps(k)
    for module in model.modules():
        if hasattr(type(module), "ops"):
            module.ops = ops
    if plan.stack and not model.arch.qk_norm:
        model._stack = build_stack(model, k)
    if plan.deterministic and model._rope_table is None:
        # One cos/sin table for every position, built once: computing them per batch runs
        # cos/sin over a tensor whose length depends on the batch, and vectorised and
        # scalar-tail elements of such kernels may round differently.
        positions = torch.arange(max_positions or model.arch.max_position_embeddings, device=model.inv_freq.device)
        cos, sin = model.rope(positions, model.model.embed_tokens.weight.dtype)
        model._rope_table = (cos[:, 0, :].contiguous(), sin[:, 0, :].contiguous())


def build_stack(model, k):
    """The decoder layers as one kernels.DecoderStack: the same kernels in the same order
    as the model's Python loop over its layers."""
    def linear(module):
        w = module.method
        bias = None if module.bias is None else module.bias.detach()
        return (w.n, w.packed, w.q_packed, w.qscale, float(w.int8_max_rows), bias, w.w8a8, w.w4a8, w.w4d, w.w4m)

    first = model.model.layers[0].self_attn
    stack = k.DecoderStack(first.num_heads, first.num_kv_heads, first.head_dim, first.scale, model.model.norm.eps,
                           model.model.norm.weight.detach())
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        stack.add_layer(linear(attn.qkv_proj), linear(attn.o_proj), linear(mlp.gate_up_proj),
                        linear(mlp.down_proj), layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach())
    return stack
