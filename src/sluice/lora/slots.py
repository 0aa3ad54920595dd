"""Resident adapters and each step's LoRA work (S-LoRA's memory shape, Punica's compute).

All adapters the server knows stay in host memory as float32 (adapters.py); at most
`max_loras` are resident at once, each in a slot of every adapted Linear, in the model's
dtype and in the form the backend multiplies fastest (`Backend.lora_weight`: on the CPU
kernels, the batch-invariant kernel's packed weights, so deterministic mode keeps its bits
with adapters mixed). A step whose adapters are not all resident loads them into the least
recently used slots that the step does not need; the scheduler never runs more distinct
adapters at once than there are slots.

Per step (`LoRAManager.prepare`) the flat batch's rows are grouped by adapter; each adapted
Linear then adds, for each group, B @ (A @ x) over the group's rows: two small matmuls per
adapter present (Punica's SGMV shape: shrink to the rank, expand to the output), never a
loop over requests and never a merged weight. Rows of the base model get nothing added.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from sluice.lora.adapters import LoRAAdapter, read_adapter

logger = logging.getLogger(__name__)


@dataclass
class LoRAStep:
    """One step's row groups: (slot, rows) per adapter present, rows a slice where the
    adapter's rows are contiguous in the flat batch, else an index tensor."""
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoRALayer:
    """The LoRA slots of one Linear (models/linear.py calls it after the base product)."""

    def __init__(self, max_loras: int):
        self.slots: list[tuple[object, object] | None] = [None] * max_loras
        self.step: LoRAStep | None = None

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step is None:
            return y
        for slot, rows in step.groups:
            w = self.slots[slot]
            if w is None:  # this adapter does not adapt this layer
                continue
            shrink, expand = w
            if isinstance(rows, slice):
                y[rows] += expand(shrink(x[rows])).to(y.dtype)
            else:
                y.index_add_(0, rows, expand(shrink(x.index_select(0, rows))).to(y.dtype))
        return y


class LoRAManager:
    """The adapters an engine serves: the registry by name, the resident slots, and each
    step's row groups. Lives with the model (the runner's process)."""

    def __init__(self, model, backend, max_loras: int, max_rank: int):
        self.model, self.backend = model, backend
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.resident: list[LoRAAdapter | None] = [None] * max_loras
        self.lru: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recent first
        from sluice.models.linear import Linear
        from sluice.lora.adapters import TARGETS
        # Every Linear an adapter may adapt: the owners of the model's q/k/v/o/gate/up/down
        # checkpoint tensors, experts apart.
        modules = dict(model.named_modules())
        owners = {slot.param.rpartition(".")[0] for name, slot in model.weight_slots().items()
                  if name.removesuffix(".weight").rpartition(".")[2] in TARGETS and ".experts." not in name}
        self.layers: dict[str, LoRALayer] = {}
        for owner in sorted(owners):
            module = modules.get(owner)
            if isinstance(module, Linear):
                module.lora = self.layers[owner] = LoRALayer(max_loras)
        self.loads = 0  # adapters copied into a slot (for metrics and tests)

    # -- the registry -----------------------------------------------------------
    def read(self, name: str, path: str) -> LoRAAdapter:
        """The adapter at `path`, read and checked (no engine state touched: off the engine
        thread is fine)."""
        return read_adapter(name, path, self.model, self.max_rank)

    def add(self, adapter: LoRAAdapter) -> None:
        if adapter.name in self.adapters:
            raise ValueError(f"a LoRA adapter named {adapter.name!r} is already loaded")
        self.adapters[adapter.name] = adapter
        logger.info("LoRA adapter %r loaded from %s: rank %d, %d layers, %.1f MB", adapter.name, adapter.path,
                    adapter.rank, len(adapter.layers), adapter.nbytes / 1e6)

    def remove(self, name: str) -> LoRAAdapter:
        """Forget an adapter: new requests cannot name it; requests already running with it
        finish with it (their slot is freed when they are done)."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise KeyError(name)
        return adapter

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter

    # -- slots ------------------------------------------------------------------
    def _load(self, adapter: LoRAAdapter, needed: set[int]) -> int:
        """A slot for the adapter: its own, a free one, or the least recently used one
        whose adapter the step does not need."""
        slot = self.lru.get(adapter.uid)
        if slot is not None:
            self.lru.move_to_end(adapter.uid)
            return slot
        free = [i for i, a in enumerate(self.resident) if a is None]
        if free:
            slot = free[0]
        else:
            victim = next((uid for uid in self.lru if uid not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras={self.max_loras} adapters at once")
            slot = self.lru.pop(victim)
        for owner, layer in self.layers.items():
            d = adapter.layers.get(owner)
            layer.slots[slot] = None if d is None else (self.backend.lora_weight(d.a), self.backend.lora_weight(d.b))
        self.resident[slot] = adapter
        self.lru[adapter.uid] = slot
        self.loads += 1
        return slot

    @property
    def num_resident(self) -> int:
        return sum(a is not None for a in self.resident)

    # -- one step ---------------------------------------------------------------
    def prepare(self, entries) -> bool:
        """Group this step's rows by adapter (entries: the plan's, in flat-batch order,
        each `lora` an adapter or None) and make those adapters resident. Returns whether
        any row has an adapter (the model then skips its fused whole-step paths)."""
        spans: dict[int, list[tuple[int, int]]] = {}
        adapters: dict[int, LoRAAdapter] = {}
        row = 0
        for e in entries:
            n = len(e.token_ids)
            if e.lora is not None:
                adapters[e.lora.uid] = e.lora
                ranges = spans.setdefault(e.lora.uid, [])
                if ranges and ranges[-1][1] == row:  # the same adapter's rows continue
                    ranges[-1] = (ranges[-1][0], row + n)
                else:
                    ranges.append((row, row + n))
            row += n
        step = None
        if spans:
            step = LoRAStep()
            needed = set(spans)
            for uid, ranges in spans.items():
                slot = self._load(adapters[uid], needed)
                if len(ranges) == 1:
                    rows = slice(*ranges[0])
                else:
                    rows = self.backend.to_device([r for lo, hi in ranges for r in range(lo, hi)])
                step.groups.append((slot, rows))
        for layer in self.layers.values():
            layer.step = step
        self.model.lora_step = step
        return step is not None
