"""Mixture-of-experts decoders over one flat batch: Qwen3-MoE, Mixtral and OLMoE.

The Llama family's attention with a sparse MLP: a router picks each token's top-k experts
(softmax over all experts, the k largest, renormalised where the config says so), and
each expert, a SwiGLU MLP of its own, runs once per step over the rows routed to it:
the (token, choice) pairs are sorted by expert and each active expert takes its rows in
one gathered matmul, weighted and added back in expert order (transformers' order, so
float32 sums match its bits). Each expert's projections are Linear layers, so every
quantization scheme and kernel the backend has applies to them; the router stays in the
model dtype (a quantized router would route differently).

Under tensor parallelism each rank holds every expert's slice of the intermediate
dimension and the experts' partial sums are all-reduced once per layer, after the last
expert, in float32.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from sluice.backends.torch_ref import TORCH_OPS
from sluice.distributed.parallel import SINGLE, TPShard, split
from sluice.models.llama import LlamaForCausalLM, WeightSlot
from sluice.models.linear import Linear

# Mixtral's checkpoint names -> Qwen3-MoE's (ours).
_MIXTRAL_NAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))


class Expert(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)


class SparseMoE(nn.Module):
    ops = TORCH_OPS

    def __init__(self, arch, tp: TPShard = SINGLE):
        super().__init__()
        self.start, self.intermediate_size = split(arch.moe_intermediate_size, tp.size, tp.rank)
        self.top_k, self.norm_topk_prob = arch.num_experts_per_tok, arch.norm_topk_prob
        self.weights_in_dtype = arch.router_weights_in_dtype
        self.gate = nn.Linear(arch.hidden_size, arch.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(arch.hidden_size, self.intermediate_size)
                                     for _ in range(arch.num_experts))
        self.reduce = tp.group  # one all-reduce of the experts' partial sums (None: one rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(F.linear(x, self.gate.weight).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)          # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_in_dtype:
            weights = weights.to(x.dtype)
        # (token, choice) pairs grouped by expert: a stable sort keeps tokens in order.
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        rows, pair_weights = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(x, dtype=torch.float32 if self.reduce is not None else x.dtype)
        at = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            expert, idx = self.experts[e], rows[at:at + n]
            h = expert.down_proj(self.ops.silu_and_mul(expert.gate_up_proj(x.index_select(0, idx))))
            out.index_add_(0, idx, (h * pair_weights[at:at + n, None]).to(out.dtype))
            at += n
        if self.reduce is not None:
            self.reduce.all_reduce(out)
            out = out.to(x.dtype)
        return out


class MoEForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE (Qwen3's per-head QK-norm) and Mixtral: LlamaArch with its MoE fields set."""

    def make_layer(self, i: int, mlp: nn.Module | None = None) -> nn.Module:
        return super().make_layer(i, SparseMoE(self.arch, self.tp) if self.arch.sparse_layers[i] else None)

    def _make_slots(self) -> dict[str, WeightSlot]:
        a = self.arch
        sparse = [i for i in range(a.num_layers) if a.sparse_layers[i]]
        # The dense slots of every layer, then the sparse layers' MLP slots replaced.
        slots = {name: s for name, s in super()._make_slots().items()
                 if not any(name.startswith(f"model.layers.{i}.mlp.") for i in sparse)}
        hidden = a.hidden_size
        for i in sparse:
            moe: SparseMoE = self.model.layers[i].mlp
            p = f"model.layers.{i}.mlp."
            slots[p + "gate.weight"] = WeightSlot(p + "gate.weight", 0, (a.num_experts, hidden))
            for e in range(a.num_experts):
                q = f"{p}experts.{e}."
                for j, proj in enumerate(("gate_proj", "up_proj")):
                    slots[f"{q}{proj}.weight"] = WeightSlot(
                        q + "gate_up_proj.weight", j * moe.intermediate_size, (a.moe_intermediate_size, hidden),
                        (0, moe.start, moe.intermediate_size))
                slots[q + "down_proj.weight"] = WeightSlot(
                    q + "down_proj.weight", 0, (hidden, a.moe_intermediate_size),
                    (1, moe.start, moe.intermediate_size))
        return slots

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], strict: bool = True):
        """As Llama's, Mixtral's names (block_sparse_moe, w1/w3/w2) read as Qwen3-MoE's."""
        def renamed(items):
            for name, tensor in items:
                if "block_sparse_moe." in name:
                    for old, new in _MIXTRAL_NAMES:
                        name = name.replace(old, new)
                yield name, tensor
        return super().load_weights(renamed(weights), strict)
