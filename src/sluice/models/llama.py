"""Llama-family decoder over one flat batch of tokens (Llama, SmolLM2, Mistral, Qwen2, Qwen3).

Grouped-query attention, RoPE (plain, linear, llama3 and YaRN scaling), RMSNorm, SwiGLU MLP,
tied or separate LM head, optional q/k/v bias (Qwen2), per-head q/k RMSNorm (Qwen3) and
sliding-window layers (Mistral; a config's layer_types).
Q/K/V and gate/up are fused into one matmul each; weights load from Hugging Face names.

Architecture and weight loading only: which implementation runs each op is the backend's
choice (backends/), set after loading by its prepare(): `ops` (norms, SwiGLU, RoPE + cache
write, attention), each Linear's `method`, `head` (the LM head) and `fast_forward` (the
whole step another way, where the backend has one). The attention record each step is
built by the backend too, and handed in as an argument.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.backends.torch_ref import TORCH_OPS
from sluice.distributed.parallel import SINGLE, TPShard, split
from sluice.models.linear import Embedding, Linear
from sluice.quantization.gguf_blocks import blocks_of


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
    # Per layer: the keys a query sees, itself included (0: every key before it); empty
    # where no layer has a sliding window (Mistral's and Mixtral's sliding_window, a config's
    # layer_types).
    layer_windows: tuple[int, ...] = ()
    # Mixture of experts (models/moe.py; 0 experts: dense). sparse_layers: per layer, whether
    # its MLP is the experts; router_weights_in_dtype: the routing weights rounded to the
    # model dtype before weighting (Qwen3-MoE) or kept in float32 (Mixtral).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    router_weights_in_dtype: bool = False
    sparse_layers: tuple[bool, ...] = ()
    # OLMoE: the q / k norms span all heads' projections (not one head), and q, k and v are
    # clipped to +-clip_qkv where the config says so.
    qk_norm_full: bool = False
    clip_qkv: float | None = None

    @classmethod
    def from_hf_config(cls, cfg) -> "LlamaArch":
        model_type = getattr(cfg, "model_type", "llama")
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # transformers >= 5 keeps theta and scaling in rope_parameters; older in rope_theta/rope_scaling.
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = rope or getattr(cfg, "rope_scaling", None) or {}
        scaling = check_rope_scaling(scaling)
        if (getattr(cfg, "partial_rotary_factor", None) or 1.0) != 1.0:
            raise ValueError(f"partial_rotary_factor {cfg.partial_rotary_factor} is not supported (RoPE on the whole head)")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        window = int(getattr(cfg, "sliding_window", None) or 0)
        types = list(getattr(cfg, "layer_types", None) or [])
        if model_type in ("mistral", "mixtral") and window:  # every layer (transformers' Mistral and Mixtral)
            windows = (window,) * cfg.num_hidden_layers
        elif window and types and (model_type != "qwen2" or getattr(cfg, "use_sliding_window", False)):
            windows = tuple(window if t == "sliding_attention" else 0 for t in types)
        else:
            windows = ()
        moe = {}
        if model_type == "qwen3_moe" and getattr(cfg, "num_experts", 0):
            step, dense = getattr(cfg, "decoder_sparse_step", 1) or 1, set(getattr(cfg, "mlp_only_layers", None) or [])
            moe = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=bool(cfg.norm_topk_prob),
                       router_weights_in_dtype=True,
                       sparse_layers=tuple(i not in dense and (i + 1) % step == 0
                                           for i in range(cfg.num_hidden_layers)))
        elif model_type == "olmoe":
            moe = dict(num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=bool(cfg.norm_topk_prob),
                       router_weights_in_dtype=True, sparse_layers=(True,) * cfg.num_hidden_layers)
        elif model_type == "mixtral":
            moe = dict(num_experts=cfg.num_local_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                       moe_intermediate_size=cfg.intermediate_size, norm_topk_prob=True,
                       sparse_layers=(True,) * cfg.num_hidden_layers)
        if moe and getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"mixture of experts with hidden_act {cfg.hidden_act!r} is not supported (silu)")
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
            qk_norm=model_type in ("qwen3", "qwen3_moe", "olmoe"),
            layer_windows=windows if any(windows) else (),
            **moe,
            qk_norm_full=model_type == "olmoe",
            clip_qkv=getattr(cfg, "clip_qkv", None) if model_type == "olmoe" else None,
        )


ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_rope_scaling(scaling: dict | None) -> dict | None:
    """The rope scaling record a config names, or None for plain RoPE; ValueError for a kind
    we do not run. Dynamic NTK is refused: its frequencies follow each sequence's current
    length, which K rotated once and kept in a paged cache cannot follow."""
    scaling = dict(scaling or {})
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)}): "
                         f"{scaling}")
    if rope_type == "default":
        return None
    scaling["rope_type"] = rope_type
    return scaling


def rope_attention_factor(arch: LlamaArch) -> float:
    """The factor cos and sin are scaled by (YaRN's attention temperature; 1 otherwise)."""
    s = arch.rope_scaling
    if not s or s["rope_type"] != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    factor = _yarn_factor(arch)
    if s.get("mscale") and s.get("mscale_all_dim"):
        return float(mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"]))
    return mscale(factor)


def _yarn_factor(arch: LlamaArch) -> float:
    s = arch.rope_scaling
    original = s.get("original_max_position_embeddings") or arch.max_position_embeddings
    return s["factor"] if s.get("factor") is not None else arch.max_position_embeddings / original


def rope_inv_freq(arch: LlamaArch) -> torch.Tensor:
    d = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    s = arch.rope_scaling
    if s and s.get("rope_type", s.get("type")) == "linear":
        inv_freq = inv_freq / s["factor"]
    if s and s.get("rope_type", s.get("type")) == "yarn":
        # YaRN (transformers' _compute_yarn_parameters): interpolated frequencies below a
        # ramp over the dimensions, the original ones above it.
        factor, base = _yarn_factor(arch), arch.rope_theta
        original = s.get("original_max_position_embeddings") or arch.max_position_embeddings

        def corr_dim(rotations: float) -> float:
            return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))
        low, high = corr_dim(s.get("beta_fast") or 32), corr_dim(s.get("beta_slow") or 1)
        if s.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        pos_freqs = base ** (torch.arange(0, d, 2).float() / d)
        extrapolation = 1 - ramp
        inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
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


def rope_cos_sin(positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor,
                 table: tuple[torch.Tensor, torch.Tensor] | None, factor: float = 1.0):
    """cos and sin [T, 1, D] of each position: from the table where there is one, else
    computed in fp32 (times `factor`, YaRN's) and applied in the model dtype (the 1
    broadcasts over heads)."""
    if table is not None:
        cos, sin = table
        return cos.index_select(0, positions)[:, None, :], sin.index_select(0, positions)[:, None, :]
    freqs = positions.float()[:, None] * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


class RopeRows:
    """cos and sin of positions [0, n) for one inv_freq, computed once and kept for a CPU
    step to gather its positions' rows: computing them costs seven small torch ops a step
    (~0.2 ms of a ~8 ms one-row decode step on a Zen 3), the gather two. Grown by doubling
    as later positions come, up to `max_bytes` a table (cos or sin); a step with a
    position beyond that computes its own (rope_cos_sin). A row is the same bits either
    way where every element goes through torch's vectorized cos and sin (a head_dim that
    is a multiple of 32, as 64, 128 and 256 are); otherwise a step's last few elements
    took the scalar path, whose rounding may differ by the batch's size, and the table
    gives each position one answer. Not on a GPU, where finding the step's last position
    would wait for the device."""

    def __init__(self, max_bytes: int = 4 << 20):
        self.max_bytes = max_bytes
        self.key = None
        self.table: tuple[torch.Tensor, torch.Tensor] | None = None

    def rows(self, positions: torch.Tensor, dtype: torch.dtype, inv_freq: torch.Tensor,
             factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The table (cos, sin) [n, D] covering every position of `positions`, or None."""
        if positions.device.type != "cpu" or positions.numel() == 0:
            return None
        top = int(positions.max()) + 1
        limit = self.max_bytes // (2 * inv_freq.numel() * dtype.itemsize)
        if top > limit:
            return None
        # inv_freq's own tensor: a model moved to another dtype has a new one.
        key = (dtype, inv_freq.data_ptr(), inv_freq.dtype, factor)
        if self.key != key or self.table[0].shape[0] < top:
            n = min(limit, max(1024, 1 << (top - 1).bit_length()))
            cos, sin = rope_cos_sin(torch.arange(n, device=positions.device), dtype, inv_freq, None, factor)
            self.key, self.table = key, (cos[:, 0, :].contiguous(), sin[:, 0, :].contiguous())
        return self.table


class RMSNorm(nn.Module):
    ops = TORCH_OPS

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    ops = TORCH_OPS

    def __init__(self, arch: LlamaArch, tp: TPShard = SINGLE):
        super().__init__()
        # This rank's KV heads (all of them in one process) and the query heads reading them.
        self.kv_start, self.num_kv_heads = split(arch.num_kv_heads, tp.size, tp.rank)
        per_kv = arch.num_heads // arch.num_kv_heads
        self.q_start, self.num_heads = self.kv_start * per_kv, self.num_kv_heads * per_kv
        self.head_dim = arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        self.o_proj.reduce = tp.group
        # Per head (Qwen3), or over all heads' projections before they are split (OLMoE).
        self.qk_norm_full, self.clip_qkv = arch.qk_norm_full, arch.clip_qkv
        q_dim, k_dim = (self.q_size, self.kv_size) if arch.qk_norm_full else (self.head_dim, self.head_dim)
        self.q_norm = RMSNorm(q_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.k_norm = RMSNorm(k_dim, arch.rms_norm_eps) if arch.qk_norm else None
        self.scale = self.head_dim ** -0.5
        # Keys a query sees, itself included (0: all before it); a sliding-window layer's.
        self.window = 0

    def forward(self, x, cos, sin, meta, kv_cache: tuple[torch.Tensor, torch.Tensor]):
        qkv, q_norm, k_norm = self.qkv_proj(x), self.q_norm, self.k_norm
        if self.qk_norm_full or self.clip_qkv is not None:
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            if self.qk_norm_full:
                q, k, q_norm, k_norm = q_norm(q), k_norm(k), None, None
            if self.clip_qkv is not None:
                q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
            qkv = torch.cat([q, k, v], dim=-1)
        q = self.ops.rope_write_kv(qkv, cos, sin, kv_cache, meta.slot_mapping, self.num_heads,
                                   self.num_kv_heads, self.head_dim, q_norm, k_norm)
        if self.window:
            o = self.ops.attention(q, kv_cache[0], kv_cache[1], meta, self.scale, self.window)
        else:
            o = self.ops.attention(q, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


class MLP(nn.Module):
    ops = TORCH_OPS

    def __init__(self, arch: LlamaArch, tp: TPShard = SINGLE):
        super().__init__()
        self.start, self.intermediate_size = split(arch.intermediate_size, tp.size, tp.rank)
        self.gate_up_proj = Linear(arch.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = Linear(self.intermediate_size, arch.hidden_size, bias=False)
        self.down_proj.reduce = tp.group

    def forward(self, x):
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPShard = SINGLE, mlp: nn.Module | None = None):
        super().__init__()
        self.self_attn = Attention(arch, tp)
        self.mlp = mlp if mlp is not None else MLP(arch, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPShard = SINGLE, make_layer=None):
        super().__init__()
        self.embed_tokens = Embedding(arch.vocab_size, arch.hidden_size)
        make_layer = make_layer or (lambda i: DecoderLayer(arch, tp))
        self.layers = nn.ModuleList(make_layer(i) for i in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)


@dataclass(frozen=True)
class WeightSlot:
    """Where one checkpoint tensor goes: rows [offset, offset + rows) of parameter `param`
    (a fused Q/K/V or gate/up parameter takes several tensors), from a checkpoint tensor
    of `shape`, of which this rank keeps `shard` = (dim, start, size) (None: all of it)."""
    param: str
    offset: int
    shape: tuple[int, ...]
    shard: tuple[int, int, int] | None = None

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor of the right shape."""
        return tensor if self.shard is None else tensor.narrow(*self.shard)


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: LlamaArch, tp: TPShard = SINGLE):
        super().__init__()
        self.arch = arch
        self.tp = tp
        self.model = LlamaModel(arch, tp, self.make_layer)
        self.lm_head = None if arch.tie_word_embeddings else Linear(arch.hidden_size, arch.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)
        # Set by the backend's prepare(): the LM head as a callable hidden -> float logits
        # (None: F.linear on the head's weight); one cos/sin table for every position (None:
        # computed per step); the whole forward pass another way, returning None for a step
        # it does not take (None: the layers below, one by one).
        self.head = None
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        self.rope_rows = RopeRows()  # where there is no rope_table: rows computed once (CPU)
        self.fast_forward = None
        # Set each step where LoRA adapters are served (lora/slots.py): the step's rows by
        # adapter when any row has one, whose deltas the Linear layers add (a fast_forward
        # adds them itself, or returns None for the step).
        self.lora_step = None

    @property
    def stackable(self) -> bool:
        """Whether the layers are the plain shape a backend's one-call decoder stack computes
        (no per-head norms, sliding windows or experts)."""
        a = self.arch
        return type(self) is LlamaForCausalLM and not a.qk_norm and not a.layer_windows and not a.num_experts

    def make_layer(self, i: int, mlp: nn.Module | None = None) -> nn.Module:
        """Decoder layer i (a subclass's own kind of layer; mlp: another MLP than the dense one)."""
        layer = DecoderLayer(self.arch, self.tp, mlp)
        if self.arch.layer_windows:
            layer.self_attn.window = self.arch.layer_windows[i]
        return layer

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        factor = rope_attention_factor(self.arch)
        table = self.rope_table or self.rope_rows.rows(positions, dtype, self.inv_freq, factor)
        return rope_cos_sin(positions, dtype, self.inv_freq, table, factor)

    def fix_rope_tables(self, max_positions: int, dtype: torch.dtype) -> None:
        """One cos/sin table for every position, built once (deterministic mode)."""
        positions = torch.arange(max_positions, device=self.inv_freq.device)
        cos, sin = rope_cos_sin(positions, dtype, self.inv_freq, None, rope_attention_factor(self.arch))
        self.rope_table = (cos[:, 0, :].contiguous(), sin[:, 0, :].contiguous())

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. meta: the step's
        attention record (backends/base.py AttentionMetadata)."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        if self.fast_forward is not None:
            h = self.fast_forward(x, cos, sin, meta, kv_caches)
            if h is not None:
                return h
        # Each residual add fused with the norm that follows it (one op on our kernels; on
        # torch's, the add and then the norm, as a layer's plain forward would).
        layers, norm = self.model.layers, self.model.norm
        h, residual = layers[0].input_layernorm(x), x
        for i, (layer, kv) in enumerate(zip(layers, kv_caches)):
            attn = layer.self_attn(h, cos, sin, meta.for_layer(i), kv)
            post = layer.post_attention_layernorm
            h, residual = post.ops.add_rms_norm(attn, residual, post.weight, post.eps)
            mlp = layer.mlp(h)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else norm
            h, residual = nxt.ops.add_rms_norm(mlp, residual, nxt.weight, nxt.eps)
        return h

    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head is not None:
            return self.head(hidden)
        return F.linear(hidden, self.head_weight())

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank holds (its KV cache's), all of them in one process."""
        return self.model.layers[0].self_attn.num_kv_heads

    def weight_slots(self) -> dict[str, WeightSlot]:
        """Every checkpoint tensor this model takes, by Hugging Face name."""
        if getattr(self, "_slots", None) is None:
            self._slots = self._make_slots()
        return self._slots

    def _make_slots(self) -> dict[str, WeightSlot]:
        a, params = self.arch, dict(self.named_parameters())
        hidden, d = a.hidden_size, a.head_dim
        slots = {}

        def plain(name: str) -> None:
            slots[name] = WeightSlot(name, 0, tuple(params[name].shape))

        plain("model.embed_tokens.weight")
        plain("model.norm.weight")
        if self.lm_head is not None:
            plain("lm_head.weight")
        for i, layer in enumerate(self.model.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            plain(p + "input_layernorm.weight")
            plain(p + "post_attention_layernorm.weight")
            qkv = [("q_proj", a.num_heads, attn.q_start, attn.num_heads),
                   ("k_proj", a.num_kv_heads, attn.kv_start, attn.num_kv_heads),
                   ("v_proj", a.num_kv_heads, attn.kv_start, attn.num_kv_heads)]
            offset = 0
            for proj, heads, start, local in qkv:
                for kind in ("weight", "bias") if a.qkv_bias else ("weight",):
                    shape = (heads * d, hidden) if kind == "weight" else (heads * d,)
                    slots[f"{p}self_attn.{proj}.{kind}"] = WeightSlot(
                        f"{p}self_attn.qkv_proj.{kind}", offset, shape, (0, start * d, local * d))
                offset += local * d
            slots[p + "self_attn.o_proj.weight"] = WeightSlot(
                p + "self_attn.o_proj.weight", 0, (hidden, a.num_heads * d), (1, attn.q_start * d, attn.q_size))
            if a.o_bias:
                plain(p + "self_attn.o_proj.bias")
            if a.qk_norm:
                plain(p + "self_attn.q_norm.weight")
                plain(p + "self_attn.k_norm.weight")
            for j, proj in enumerate(("gate_proj", "up_proj")):
                slots[f"{p}mlp.{proj}.weight"] = WeightSlot(
                    p + "mlp.gate_up_proj.weight", j * mlp.intermediate_size, (a.intermediate_size, hidden),
                    (0, mlp.start, mlp.intermediate_size))
            slots[p + "mlp.down_proj.weight"] = WeightSlot(
                p + "mlp.down_proj.weight", 0, (hidden, a.intermediate_size), (1, mlp.start, mlp.intermediate_size))
        return slots

    def weight_slot(self, name: str) -> WeightSlot | None:
        """Where checkpoint tensor `name` goes; None for a tensor loading skips (rotary
        tables; the head's copy when the embedding is the head); ValueError for one that
        has no place in this model."""
        slot = self.weight_slots().get(name)
        if slot is not None:
            return slot
        if "rotary_emb" in name or (name == "lm_head.weight" and self.lm_head is None):
            return None
        raise ValueError(f"checkpoint tensor {name!r} has no place in the model")

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True
                     ) -> dict[str, list[tuple[int, int]]]:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, this rank's
        shard of each. strict: every tensor the model takes must come. Returns, per
        parameter written, the (first row, rows) ranges written."""
        params = dict(self.named_parameters())
        written: dict[str, list[tuple[int, int]]] = {}
        seen: set[str] = set()
        for name, tensor in weights:
            slot = self.weight_slot(name)
            if slot is None:
                continue
            if tuple(tensor.shape) != slot.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {slot.shape}")
            part = slot.take(tensor)
            param = params[slot.param]
            dst = param if slot.offset == 0 and part.shape == param.shape else param.narrow(0, slot.offset, part.shape[0])
            blocks = getattr(tensor, "gguf_blocks", None)
            owner = self.get_submodule(slot.param.rpartition(".")[0])
            writer = getattr(owner, "write_rows", None) if slot.param.endswith(".weight") else None
            fp8 = getattr(tensor, "fp8", None)
            if writer is not None and dst.device.type == "meta":
                # A layer whose scheme released its weight for another form (FP8) quantizes
                # the new rows itself.
                writer(slot.offset, part)
            elif dst.device.type == "meta":  # a layer built without weights: its blocks are
                if blocks is None or part.shape != tensor.shape:
                    raise ValueError(f"{name}: a layer built without weights takes a GGUF's blocks whole")
            elif tensor.device.type == "meta":  # only the blocks came: the values from them
                dst.copy_(blocks_of(blocks))
            else:
                dst.copy_(part)
            if fp8 is not None and part.shape == tensor.shape and writer is None:
                # The checkpoint's own FP8 values and scales of these rows, for quantization='fp8'.
                owner.source_fp8 = {**(getattr(owner, "source_fp8", None) or {}), slot.offset: fp8}
            if blocks is not None and part.shape == tensor.shape:
                # The file's own quantized blocks of these rows, for quantization='gguf'.
                owner.source_blocks = {**(getattr(owner, "source_blocks", None) or {}), slot.offset: blocks}
            written.setdefault(slot.param, []).append((slot.offset, dst.shape[0]))
            seen.add(name)
        if strict:
            self.check_checkpoint_names(seen)
        return written

    def check_checkpoint_names(self, names) -> None:
        """One ValueError if the checkpoint's tensor names lack any the model takes."""
        missing = sorted(set(self.weight_slots()) - set(names))
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
