"""Llama-family decoder over one flat batch of tokens (Llama, SmolLM2, Qwen2, Qwen3).

Grouped-query attention, RoPE (default and llama3 scaling), RMSNorm, SwiGLU MLP,
tied or separate LM head, optional q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3).
Q/K/V and gate/up are fused into one matmul each; weights load from Hugging Face names.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.models.linear import (INT8_MAX_ROWS, KernelWeight, Linear, kernel_weight, prepack_linears,
                                  prepack_weight, quantize_int8, quantize_per_channel, use_kernels)
from sluice.worker.attention import AttentionMetadata, flat_attention_kernel, paged_attention, write_kv


# Tokens per row that the greedy fast path rescores exactly (see greedy_tokens).
GREEDY_CANDIDATES = 16


@dataclass
class LlamaArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf_config(cls, cfg) -> "LlamaArch":
        model_type = getattr(cfg, "model_type", "llama")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # transformers >= 5 keeps theta and scaling in rope_parameters; older in rope_theta/rope_scaling.
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = rope or getattr(cfg, "rope_scaling", None) or {}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"unsupported rope scaling {scaling}")
        scaling = scaling if rope_type == "llama3" else None
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling or None,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias,
            qk_norm=model_type == "qwen3",
        )


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = arch.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class RMSNorm(nn.Module):
    kernels: object | None = None  # the C++ kernels, when they run this model

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.bi_rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    kernels: object | None = None  # the C++ kernels, when they run this model

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        T = x.shape[0]
        k_cache, v_cache = kv_cache
        if self.kernels is not None and self.q_norm is None:
            # One C++ pass for RoPE and the cache write (some twenty torch ops otherwise).
            q = self.kernels.rope_write_kv(self.qkv_proj(x), cos, sin, k_cache, v_cache, meta.slot_mapping,
                                           self.num_heads, self.num_kv_heads)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)
            return self.o_proj(o.reshape(T, self.q_size))
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    kernels: object | None = None

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.intermediate_size = arch.intermediate_size
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x):
        if self.kernels is not None:
            return self.down_proj(self.kernels.bi_silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.self_attn = Attention(arch)
        self.mlp = MLP(arch)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)

    def forward(self, x, cos, sin, meta, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    # Hugging Face checkpoint name -> (our fused parameter, shard index).
    _stacked = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, arch: LlamaArch):
        super().__init__()
        self.arch = arch
        self.model = LlamaModel(arch)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        self._packed_embedding: torch.Tensor | None = None
        self._int8_head: tuple[torch.Tensor, torch.Tensor] | None = None
        self._kernel_head: KernelWeight | None = None  # the head, when the C++ kernels run the model
        # Greedy fast path: (kernels, w8a8-packed int8 head, its scales, the bf16 head packed).
        self._greedy_head: tuple | None = None
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self._stack = None  # the layers as one C++ call (kernels.DecoderStack), when the kernels run them

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        if self._rope_table is not None:
            cos, sin = self._rope_table
            return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]
        freqs = positions.float()[:, None] * self.inv_freq[None, :].float()
        emb = torch.cat((freqs, freqs), dim=-1)
        # [T, 1, D]: broadcast over heads; computed in fp32, applied in the model dtype.
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if self._stack is not None and flat_attention_kernel(meta) is not None:
            # Attention is one flat kernel call here, so the whole stack runs in C++: the
            # same kernels in the same order as the loop below, without ~300 Python calls.
            return self._stack.forward(x, cos, sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                       meta.query_start_loc, meta.seq_lens)
        layers = self.model.layers
        if self.model.norm.kernels is not None:
            # Each residual add fused with the norm that follows it: the same bits as
            # the layers' own forward, half the op calls on that path.
            k = self.model.norm.kernels
            h, residual = layers[0].input_layernorm(x), x
            for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
                attn = layer.self_attn(h, cos, sin, meta, kv)
                norm = layer.post_attention_layernorm
                h, residual = k.bi_add_rms_norm(attn, residual, norm.weight, norm.eps)
                mlp = layer.mlp(h)
                norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
                h, residual = k.bi_add_rms_norm(mlp, residual, norm.weight, norm.eps)
            return h
        for layer, kv in zip(layers, kv_caches):
            x = layer(x, cos, sin, meta, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._kernel_head is not None:  # float32 logits, a fixed reduction order per row
            return self._kernel_head(hidden, None, True)
        if self.lm_head is not None:
            return self.lm_head(hidden)
        if self._int8_head is not None and hidden.shape[0] <= INT8_MAX_ROWS:
            return torch.ops.aten._weight_int8pack_mm(hidden, *self._int8_head)
        if self._packed_embedding is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self._packed_embedding, None, "none", [], "")
        return F.linear(hidden, self.model.embed_tokens.weight)

    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax of compute_logits(hidden) per row, or None where this model has no
        fast path for it. The head runs in int8 x int8 (w8a8, ~0.6x the time of the bf16
        head at 32 rows and ~0.3x at one) and its GREEDY_CANDIDATES best tokens per row are
        rescored with the bf16 head's own arithmetic (the same bits); the best of those is
        the answer. That is the full head's argmax unless int8 rounding pushed the true best
        below GREEDY_CANDIDATES others (not seen in benchmarks/quality.py's runs)."""
        if self._greedy_head is None or hidden.dtype != torch.bfloat16:
            return None
        k, w8, scale, packed = self._greedy_head
        approx = k.w8a8_linear(hidden, w8, scale, self.arch.vocab_size, None, True)
        return k.greedy_head(approx, hidden, packed, GREEDY_CANDIDATES)

    def optimize_for(self, plan, quantization: str | None = None, max_positions: int | None = None) -> None:
        """After loading, set the layers up as the backend plan says (backends/select.py
        decides; nothing here looks at the hardware): quantize if asked, then run every
        linear layer, RMSNorm, SwiGLU and RoPE through the plan's kernels, or prepack the
        weights for oneDNN. Deterministic mode also fixes the RoPE values."""
        if quantization in ("int8", "w8a8"):  # the same int8 weights; w8a8 also quantizes activations
            quantize_int8(self, plan.dtype)
            if self.lm_head is None:
                # Tied head: an int8 copy for the head; the embedding table stays as loaded.
                q, scale = quantize_per_channel(self.model.embed_tokens.weight)
                self._int8_head = (q, scale.to(plan.dtype))
        elif quantization is not None:
            raise ValueError(f"quantization must be None, 'int8' or 'w8a8', got {quantization!r}")
        if plan.model_kernels is not None:
            self._use_kernels(plan.model_kernels, plan.deterministic,
                              max_positions or self.arch.max_position_embeddings, plan.linear == "kernels-w8a8",
                              plan.head == "kernels-greedy-w8a8")
        elif plan.linear.endswith("onednn-bf16"):
            prepack_linears(self)
            if self.lm_head is None:  # tied head: a packed copy beside the embedding table
                self._packed_embedding = prepack_weight(self.model.embed_tokens.weight)

    @torch.no_grad()
    def _use_kernels(self, k, deterministic: bool, max_positions: int, w8a8: bool, greedy_head: bool) -> None:
        # w8a8 everywhere but the LM head and the first and last decoder layers, which keep
        # bf16 activations: on SmolLM2 int8 activations in the head took the KL divergence
        # from float32 from 0.006 to 0.009, and in the two end layers from 0.0054 to 0.0063
        # (and flipped the answer to "What is the capital of France?"), for ~1% of the speed.
        last = len(self.model.layers) - 1
        use_kernels(self, k, deterministic,
                    ("lm_head", "model.layers.0.", f"model.layers.{last}.") if w8a8 else None)
        if self.lm_head is None:  # tied head: its own packed copy of the embedding table
            self._kernel_head = kernel_weight(k, self.model.embed_tokens.weight, self._int8_head, deterministic)
        else:
            self._kernel_head = self.lm_head.kernel
        self._int8_head = None
        if greedy_head and self._kernel_head.packed is not None:
            # The same weight the bf16 head multiplies by, in int8 for the greedy fast path.
            w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            q, scale = quantize_per_channel(w)
            self._greedy_head = (k, k.w8a8_pack_weight(q), scale.float().contiguous(), self._kernel_head.packed)
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP, Attention)):
                module.kernels = k
        if not self.arch.qk_norm and hasattr(k, "DecoderStack"):
            self._stack = self._build_stack(k)
        if not deterministic:
            return
        # One cos/sin table for every position, built once: computing them per batch runs
        # cos/sin over a tensor whose length depends on the batch, and vectorised and
        # scalar-tail elements of such kernels may round differently.
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        cos, sin = self.rope(positions, self.model.embed_tokens.weight.dtype)
        self._rope_table = (cos[:, 0, :].contiguous(), sin[:, 0, :].contiguous())

    def _build_stack(self, k):
        def linear(module: Linear):
            w: KernelWeight = module.kernel
            bias = None if module.bias is None else module.bias.detach()
            return (w.n, w.packed, w.q_packed, w.qscale, float(w.int8_max_rows), bias, w.w8a8)

        a = self.arch
        first = self.model.layers[0].self_attn
        stack = k.DecoderStack(a.num_heads, a.num_kv_heads, a.head_dim, first.scale, self.model.norm.eps,
                               self.model.norm.weight.detach())
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack.add_layer(linear(attn.qkv_proj), linear(attn.o_proj), linear(mlp.gate_up_proj),
                            linear(mlp.down_proj), layer.input_layernorm.weight.detach(),
                            layer.post_attention_layernorm.weight.detach())
        return stack

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        arch = self.arch
        qkv_sizes = [arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim,
                     arch.num_kv_heads * arch.head_dim]
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in self._stacked:
                    fused, shard = self._stacked[part]
                    parts[i] = fused
                    target = ".".join(parts)
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(param.shape)}")
                param.copy_(tensor)
                loaded.add(target)
            else:
                sizes = qkv_sizes if "qkv_proj" in target else [arch.intermediate_size] * 2
                offset = sum(sizes[:shard])
                dst = param.narrow(0, offset, sizes[shard])
                if dst.shape != tensor.shape:
                    raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dst.shape)}")
                dst.copy_(tensor)
                loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                expected |= {f"{pname}#{i}" for i in range(3)}
            elif pname.endswith("gate_up_proj.weight"):
                expected |= {f"{pname}#{i}" for i in range(2)}
            else:
                expected.add(pname)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
