"""Reading a PEFT LoRA adapter folder and checking it against the model it is meant for.

A folder holds `adapter_config.json` (peft_type LORA: r, lora_alpha, target_modules,
use_rslora, rank_pattern / alpha_pattern) and `adapter_model.safetensors` (or PEFT's older
`adapter_model.bin`), whose tensors are named
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r].

Each target module is placed through the model's own checkpoint map (weight_slots: the
Hugging Face name -> the fused parameter and its row offset), so q/k/v land in the fused
qkv projection and gate/up in the fused gate_up one, for every architecture the loader
knows. Everything is checked before anything is kept: a missing file, a shape that does not
fit, a target sluice does not adapt, DoRA and the like are one ValueError naming the
adapter and what is wrong.
"""
from __future__ import annotations

import itertools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

# The projections an adapter may target (PEFT's module names in Llama-family models).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_NAME_CHARS = 256
_uids = itertools.count(1)


@dataclass
class LayerDelta:
    """One model Linear's share of an adapter, in the fused layer's terms: y += B @ (A @ x),
    with A [sum of ranks, in] the target modules' A stacked, and B [out, sum of ranks] each
    module's B (times its scaling) at its rows of the fused output, zeros elsewhere."""
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class LoRAAdapter:
    name: str
    path: str
    rank: int                                  # the largest of its modules' ranks
    layers: dict[str, LayerDelta]              # model Linear's name -> its delta
    # Unique per load: a reloaded adapter of the same name is another one (its own
    # prefix-cache blocks and resident slot).
    uid: int = field(default_factory=lambda: next(_uids))

    @property
    def nbytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + d.b.numel() * d.b.element_size()
                   for d in self.layers.values())


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module's
    name at its end (a regex, as PEFT matches it)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_tensors(folder: Path, name: str) -> dict[str, torch.Tensor]:
    st, binary = folder / "adapter_model.safetensors", folder / "adapter_model.bin"
    try:
        if st.is_file():
            from safetensors.torch import load_file
            return load_file(str(st))
        if binary.is_file():
            return torch.load(str(binary), map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"LoRA adapter {name!r}: cannot read its weights in {folder}: {e}") from None
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors (or adapter_model.bin) in {folder}")


def read_adapter(name: str, path: str, model, max_rank: int) -> LoRAAdapter:
    """The adapter in PEFT folder `path`, checked against `model` (a loaded sluice model:
    its weight_slots and modules), as float32 deltas. ValueError for anything that would
    not run exactly as PEFT computes it."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or name != name.strip():
        raise ValueError(f"a LoRA adapter's name must be 1-{MAX_NAME_CHARS} characters without surrounding "
                         f"spaces, got {name!r}")
    folder = Path(path).expanduser()
    cfg_file = folder / "adapter_config.json"
    if not cfg_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {str(folder)!r}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"LoRA adapter {name!r}: adapter_config.json must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    unsupported = [f"peft_type {peft_type}" if peft_type != "LORA" else None,
                   "use_dora (DoRA)" if cfg.get("use_dora") else None,
                   f"bias={cfg.get('bias')!r}" if cfg.get("bias", "none") != "none" else None,
                   "fan_in_fan_out" if cfg.get("fan_in_fan_out") else None,
                   f"modules_to_save {cfg['modules_to_save']}" if cfg.get("modules_to_save") else None]
    unsupported = [u for u in unsupported if u]
    if unsupported:
        raise ValueError(f"LoRA adapter {name!r}: {', '.join(unsupported)} is not supported "
                         f"(plain LoRA on {', '.join(TARGETS)})")
    try:
        alpha, rank_default = float(cfg.get("lora_alpha", 8)), int(cfg.get("r", 8))
    except (TypeError, ValueError):
        raise ValueError(f"LoRA adapter {name!r}: r and lora_alpha must be numbers") from None
    rslora = bool(cfg.get("use_rslora", False))
    tensors = _read_tensors(folder, name)

    # module name (the model's HF name, e.g. model.layers.0.self_attn.q_proj) -> {"A": .., "B": ..}
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = re.fullmatch(r"(?:base_model\.model\.)?(.+)\.lora_(A|B)(?:\.[^.]+)?\.weight", key)
        if m is None:
            raise ValueError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B weight "
                             f"(supported targets: {', '.join(TARGETS)})")
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: its weights file holds no LoRA tensors")

    slots, modules = model.weight_slots(), dict(model.named_modules())
    from sluice.models.linear import Linear
    per_layer: dict[str, list[tuple[int, int, torch.Tensor, torch.Tensor]]] = {}
    top_rank = 0
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} has lora_{next(iter(ab))} without "
                             f"its lora_{'B' if 'A' in ab else 'A'}")
        slot = slots.get(module + ".weight")
        owner = slot.param.rpartition(".")[0] if slot is not None else None
        short = module.rpartition(".")[2]
        if (slot is None or short not in TARGETS or ".experts." in module
                or not isinstance(modules.get(owner), Linear)):
            raise ValueError(f"LoRA adapter {name!r}: target module {module!r} is not supported on this model "
                             f"(supported: {', '.join(TARGETS)} of its attention and dense MLP layers)")
        a, b = ab["A"].float(), ab["B"].float()
        out_features, in_features = slot.shape
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}; this model takes [r, {in_features}] and [{out_features}, r] "
                             f"(an adapter for another model?)")
        if not 1 <= r <= max_rank:
            raise ValueError(f"LoRA adapter {name!r}: rank {r} of {module} is above max_lora_rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise ValueError(f"LoRA adapter {name!r}: {module} holds values that are not finite")
        # PEFT: scaling = alpha / r (rsLoRA: alpha / sqrt(r)), r and alpha per module where
        # the patterns name it; r is the tensors' own.
        mod_alpha = float(_pattern_value(cfg.get("alpha_pattern"), module, alpha))
        mod_rank = int(_pattern_value(cfg.get("rank_pattern"), module, rank_default))
        if mod_rank != r:
            raise ValueError(f"LoRA adapter {name!r}: {module} has rank {r} but its config says {mod_rank}")
        scaling = mod_alpha / (math.sqrt(r) if rslora else r)
        per_layer.setdefault(owner, []).append((slot.offset, r, a, b * scaling))
        top_rank = max(top_rank, r)

    layers = {}
    for owner, parts in per_layer.items():
        parts.sort(key=lambda p: p[0])
        out_features = modules[owner].weight.shape[0]
        a = torch.cat([p[2] for p in parts])
        b = torch.zeros(out_features, a.shape[0])
        col = 0
        for offset, r, _, b_part in parts:
            b[offset:offset + b_part.shape[0], col:col + r] = b_part
            col += r
        layers[owner] = LayerDelta(a.contiguous(), b.contiguous())
    return LoRAAdapter(name, str(folder), top_rank, layers)
