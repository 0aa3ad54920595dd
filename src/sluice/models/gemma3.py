"""Gemma 3 (text) over one flat batch of tokens: the Llama family's layers with Gemma's changes.

- Interleaved attention: most layers see a sliding window of the last `sliding_window`
  positions (their own RoPE base, `rope_local_base_freq`), every sixth sees everything
  (`layer_types` in the config names each layer's kind).
- Four RMSNorms a layer (before and after attention, before and after the MLP), each
  scaling by 1 + weight: the parameters hold 1 + the checkpoint's weight, added at load and
  kept in float32 whatever the model dtype (the norm ops then round the product once).
- QK-norm per head, GeGLU (tanh-approximated GELU), the embedding scaled by sqrt(hidden),
  attention scaled by query_pre_attn_scalar ** -0.5, and optional final logit soft-capping.

Architecture and weight loading only, like llama.py: the backend's ops run each op, and
attention gets the layer's window (backends/torch_ref.py masks it).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

import torch

from sluice.distributed.parallel import SINGLE, TPShard
from sluice.models.llama import (MLP, Attention, LlamaArch, LlamaForCausalLM, RMSNorm, RopeRows, WeightSlot,
                                 rope_cos_sin, rope_inv_freq)

_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass
class Gemma3Arch(LlamaArch):
    rope_local_theta: float = 10000.0
    embed_scale: float = 1.0
    attn_scale: float = 1.0
    final_logit_softcapping: float | None = None

    @classmethod
    def from_hf_config(cls, cfg) -> "Gemma3Arch":
        cfg = getattr(cfg, "text_config", None) or cfg
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTIVATIONS:
            raise ValueError(f"Gemma 3 with hidden_activation {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("Gemma 3 with bidirectional attention (an encoder) is not supported")
        base = LlamaArch.from_hf_config(cfg)  # sizes, heads, biases; what differs is set below
        # transformers >= 5: rope_parameters per layer kind; older: rope_theta, rope_local_base_freq, rope_scaling.
        params = getattr(cfg, "rope_parameters", None) or {}
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        if not full:
            full = dict(getattr(cfg, "rope_scaling", None) or {})
            full.setdefault("rope_theta", getattr(cfg, "rope_theta", 1_000_000.0))
        local.setdefault("rope_theta", getattr(cfg, "rope_local_base_freq", 10000.0))
        for kind, rope in (("full", full), ("sliding", local)):
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", "linear") or (kind == "sliding" and rope_type != "default"):
                raise ValueError(f"unsupported rope scaling {rope} for Gemma 3's {kind}-attention layers")
        types = list(getattr(cfg, "layer_types", None) or [])
        if len(types) != cfg.num_hidden_layers or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"Gemma 3 config: layer_types {types} is not one of sliding_attention / "
                             f"full_attention per layer ({cfg.num_hidden_layers} layers)")
        window = int(cfg.sliding_window or 0)
        scaling = full if full.get("rope_type", full.get("type", "default")) == "linear" else None
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(LlamaArch)}
        fields.update(rope_theta=float(full["rope_theta"]), rope_scaling=scaling, qk_norm=True,
                      tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
                      layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types))
        return cls(**fields, rope_local_theta=float(local["rope_theta"]),
                   embed_scale=float(cfg.hidden_size) ** 0.5,
                   attn_scale=float(getattr(cfg, "query_pre_attn_scalar", base.head_dim)) ** -0.5,
                   final_logit_softcapping=getattr(cfg, "final_logit_softcapping", None))


class GeGLU(MLP):
    def forward(self, x):
        return self.down_proj(self.ops.gelu_tanh_and_mul(self.gate_up_proj(x)))


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, arch: Gemma3Arch, window: int, tp: TPShard = SINGLE):
        super().__init__()
        self.self_attn = Attention(arch, tp)
        self.self_attn.scale = arch.attn_scale
        self.self_attn.window = window
        self.mlp = GeGLU(arch, tp)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(arch.hidden_size, arch.rms_norm_eps))


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, arch: Gemma3Arch, tp: TPShard = SINGLE):
        super().__init__(arch, tp)
        local = dataclasses.replace(arch, rope_theta=arch.rope_local_theta, rope_scaling=None)
        self.register_buffer("local_inv_freq", rope_inv_freq(local), persistent=False)
        self.local_rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.local_rope_rows = RopeRows()

    def _apply(self, fn, recurse=True):
        """As nn.Module's (.to(dtype) and the like), the norms' 1 + w then back in float32:
        Gemma multiplies by it in float32 and rounds the product once (with a bf16 1 + w,
        bfloat16's KL from float32 on held-out text was 0.0091 rather than 0.0067,
        docs/benchmarks.md)."""
        super()._apply(fn, recurse)
        for module in self.modules():
            if isinstance(module, RMSNorm) and module.weight.dtype != torch.float32:
                module.weight.data = module.weight.data.float()
        return self

    def make_layer(self, i: int) -> torch.nn.Module:
        return Gemma3DecoderLayer(self.arch, self.arch.layer_windows[i], self.tp)

    def fix_rope_tables(self, max_positions: int, dtype: torch.dtype) -> None:
        super().fix_rope_tables(max_positions, dtype)
        positions = torch.arange(max_positions, device=self.local_inv_freq.device)
        cos, sin = rope_cos_sin(positions, dtype, self.local_inv_freq, None)
        self.local_rope_table = (cos[:, 0, :].contiguous(), sin[:, 0, :].contiguous())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        emb = self.model.embed_tokens(input_ids)
        # The scale rounded to the weights' dtype first, as Gemma's own code does.
        x = emb * torch.tensor(self.arch.embed_scale, dtype=emb.dtype)
        full = self.rope(positions, x.dtype)
        local_table = self.local_rope_table or self.local_rope_rows.rows(positions, x.dtype, self.local_inv_freq)
        local = rope_cos_sin(positions, x.dtype, self.local_inv_freq, local_table)
        layers, norm = self.model.layers, self.model.norm
        h, residual = layers[0].input_layernorm(x), x
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            cos, sin = local if layer.self_attn.window else full
            attn = layer.post_attention_layernorm(layer.self_attn(h, cos, sin, meta.for_layer(i), kv))
            pre = layer.pre_feedforward_layernorm
            h, residual = pre.ops.add_rms_norm(attn, residual, pre.weight, pre.eps)
            mlp = layer.post_feedforward_layernorm(layer.mlp(h))
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else norm
            h, residual = nxt.ops.add_rms_norm(mlp, residual, nxt.weight, nxt.eps)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.arch.final_logit_softcapping
        # Monotonic: a greedy argmax taken before the cap (a backend's greedy head) is the same.
        # In place, the same ops in the same order (so the same bits): [rows, 262,144] float32
        # twice over was most of the cap's cost (two fresh buffers' page faults each step).
        return logits if cap is None else logits.div_(cap).tanh_().mul_(cap)

    def _make_slots(self) -> dict[str, WeightSlot]:
        slots = super()._make_slots()
        params = dict(self.named_parameters())
        for i in range(self.arch.num_layers):
            for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
                name = f"model.layers.{i}.{norm}.weight"
                slots[name] = WeightSlot(name, 0, tuple(params[name].shape))
        return slots

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True):
        """As Llama's, each norm's checkpoint weight w stored as 1 + w (computed in float32)."""
        def plus_one(items):
            for name, tensor in items:
                yield name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
        return super().load_weights(plus_one(weights), strict)

