"""Resident adapters and each step's LoRA work (S-LoRA's memory shape, Punica's compute).

All adapters the server knows stay in host memory as float32 (adapters.py); at most
`max_loras` are resident at once, each in a slot of every adapted Linear, in the model's
dtype. A step whose adapters are not all resident loads them into the least recently used
slots that the step does not need; the scheduler never runs more distinct adapters at once
than there are slots.

Per step (`LoRAManager.prepare`) each row of the flat batch is given its adapter's slot;
each adapted Linear then adds B @ (A @ x) to the rows that have one, never through a merged
weight. How is the backend's choice (`Backend.lora_kernel`):
- its kernel (the CPU kernels' lora.cpp): one call per layer for every adapter of the step
  (Punica's SGMV), the slots stacked per layer as A^T [slots, in, rank] and B^T in blocks
  of 16 outputs [slots, out / 16, rank, 16];
- else torch: per adapter present, its rows gathered (a slice where contiguous), two
  matmuls (shrink to the rank, expand to the outputs), the result added back.
Rows of the base model get nothing added.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sluice.lora.adapters import TARGETS, LayerDelta, LoRAAdapter, read_adapter

logger = logging.getLogger(__name__)
# The kernel's stacks hold ranks, and outputs, in blocks of this many (lora.cpp's kLanes).
RANK_LANES = 16


def output_blocks(b: torch.Tensor) -> torch.Tensor:
    """B [out, r] as the kernel's expand reads it: B^T in blocks of 16 outputs,
    [ceil(out / 16), r, 16], zeros past out."""
    out, r = b.shape
    blocks = -(-out // RANK_LANES)
    padded = torch.zeros(blocks * RANK_LANES, r, dtype=b.dtype)
    padded[:out] = b
    return padded.reshape(blocks, RANK_LANES, r).transpose(1, 2).contiguous()


@dataclass
class LoRAStep:
    """One step's rows by adapter: for the kernel, each row's slot (-1: none) over the
    padded batch; for torch, (slot, rows) per adapter present, rows a slice where the
    adapter's rows are contiguous, else an index tensor."""
    row_slot: torch.Tensor | None = None
    groups: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)


class LoRALayer:
    """The LoRA slots of one Linear (models/linear.py calls it after the base product)."""

    def __init__(self, manager: "LoRAManager", in_features: int, out_features: int):
        # The step's rows by adapter are the manager's (one record a step for every layer).
        self.manager = manager
        self.kernel, self.dtype, self.device = manager.kernel, manager.backend.dtype, manager.backend.device
        self.in_features, self.out_features = in_features, out_features
        max_loras, dtype, device = manager.max_loras, self.dtype, self.device
        # The kernel's stacks (grown to the largest resident rank), and each slot's rank here.
        self.out_blocks = -(-out_features // RANK_LANES)
        self.at = torch.zeros(max_loras, in_features, 0, dtype=dtype, device=device)
        self.bt = torch.zeros(max_loras, self.out_blocks, 0, RANK_LANES, dtype=dtype, device=device)
        self.ranks = torch.zeros(max_loras, dtype=torch.int32)
        # torch's: each slot's (A, B), None where its adapter does not adapt this layer.
        self.pairs: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * max_loras

    def load(self, slot: int, delta: LayerDelta | None) -> bool:
        """Put an adapter's delta in a slot; returns whether the stacks were reallocated."""
        if self.kernel is None:
            self.pairs[slot] = None if delta is None else (
                delta.a.to(self.device, self.dtype), delta.b.to(self.device, self.dtype))
            return False
        r = 0 if delta is None else delta.a.shape[0]
        grown = r > self.at.shape[2]
        if grown:  # a larger rank than any resident before: the stacks grow
            cap = -(-r // RANK_LANES) * RANK_LANES
            at = torch.zeros(self.at.shape[0], self.in_features, cap, dtype=self.dtype, device=self.device)
            bt = torch.zeros(self.bt.shape[0], self.out_blocks, cap, RANK_LANES, dtype=self.dtype, device=self.device)
            at[:, :, :self.at.shape[2]] = self.at
            bt[:, :, :self.bt.shape[2], :] = self.bt
            self.at, self.bt = at, bt
        self.at[slot].zero_()  # the kernel reads the stack's whole rank blocks; past r they are zeros
        self.bt[slot].zero_()
        if r:
            self.at[slot, :, :r] = delta.a.t().to(self.dtype)
            self.bt[slot, :, :r, :] = output_blocks(delta.b).to(self.dtype)
        self.ranks[slot] = r
        return grown

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        step = self.manager.step
        if step is None:
            return y
        if self.kernel is not None:
            y = y.contiguous()
            self.kernel(y, x.contiguous(), self.at, self.bt, self.ranks, step.row_slot)
            return y
        for slot, rows in step.groups:
            pair = self.pairs[slot]
            if pair is None:  # this adapter does not adapt this layer
                continue
            a, b = pair
            if isinstance(rows, slice):
                y[rows] += F.linear(F.linear(x[rows], a), b).to(y.dtype)
            else:
                y.index_add_(0, rows, F.linear(F.linear(x.index_select(0, rows), a), b).to(y.dtype))
        return y


class LoRAManager:
    """The adapters an engine serves: the registry by name, the resident slots, and each
    step's rows by adapter. Lives with the model (the runner's process)."""

    def __init__(self, model, backend, max_loras: int, max_rank: int):
        self.model, self.backend = model, backend
        self.max_loras, self.max_rank = max_loras, max_rank
        self.adapters: dict[str, LoRAAdapter] = {}
        self.resident: list[LoRAAdapter | None] = [None] * max_loras
        self.lru: OrderedDict[int, int] = OrderedDict()  # adapter uid -> slot, least recent first
        self.kernel = backend.lora_kernel()
        self.step: LoRAStep | None = None  # this step's rows by adapter (prepare); None: no adapter in it
        from sluice.models.linear import Linear
        # Every Linear an adapter may adapt: the owners of the model's q/k/v/o/gate/up/down
        # checkpoint tensors, experts apart.
        modules = dict(model.named_modules())
        owners = {slot.param.rpartition(".")[0] for name, slot in model.weight_slots().items()
                  if name.removesuffix(".weight").rpartition(".")[2] in TARGETS and ".experts." not in name}
        self.layers: dict[str, LoRALayer] = {}
        for owner in sorted(owners):
            module = modules.get(owner)
            if isinstance(module, Linear):
                out_features, in_features = module.weight.shape
                module.lora = self.layers[owner] = LoRALayer(self, in_features, out_features)
        self.loads = 0  # adapters copied into a slot (for metrics and tests)
        which = {"self_attn.qkv_proj": 0, "self_attn.o_proj": 1, "mlp.gate_up_proj": 2, "mlp.down_proj": 3}
        self.stack_places: dict[str, tuple[int, int]] = {}
        for owner in self.layers:
            parts = owner.split(".")  # model.layers.<i>.<module>.<linear>
            if len(parts) == 5 and parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in which:
                self.stack_places[owner] = (int(parts[2]), which[".".join(parts[3:])])
        self.fast = None
        self.attach_fast()

    def attach_fast(self) -> None:
        """Give the model's whole-step fast path (the CPU kernels' decoder stack), where it
        takes adapters, every layer's slots; again after the backend rebuilt it (a weight
        update). A fast path that cannot take them must return None for LoRA steps."""
        fast = getattr(self.model, "fast_forward", None)
        self.fast = fast if hasattr(fast, "attach_lora") else None
        if self.fast is not None:
            self.fast.attach_lora(self)
            self._sync_fast()

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
        """Forget a loaded adapter: new requests cannot name it; requests already running
        with it finish with it (its slot goes to the next adapter that needs one)."""
        return self.adapters.pop(name)

    def get(self, name: str) -> LoRAAdapter:
        adapter = self.adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return adapter

    # -- slots ------------------------------------------------------------------
    def _slot(self, adapter: LoRAAdapter, needed: set[int]) -> int:
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
        grown = False
        for owner, layer in self.layers.items():
            grown |= layer.load(slot, adapter.layers.get(owner))
        if grown:
            self._sync_fast()
        self.resident[slot] = adapter
        self.lru[adapter.uid] = slot
        self.loads += 1
        return slot

    def _sync_fast(self) -> None:
        """Hand the fast path every layer's current stacks (after a stack grew)."""
        if self.fast is None or self.kernel is None:
            return
        for owner, (i, which) in self.stack_places.items():
            layer = self.layers[owner]
            self.fast.set_lora(i, which, layer.at, layer.bt, layer.ranks)

    @property
    def num_resident(self) -> int:
        return sum(a is not None for a in self.resident)

    # -- one step ---------------------------------------------------------------
    def prepare(self, entries, num_rows: int) -> None:
        """Give this step's rows their adapters' slots (entries: the plan's, in flat-batch
        order, each `lora` an adapter or None; num_rows: the batch's rows, padding
        included), loading adapters that are not resident."""
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
            slots = {uid: self._slot(adapters[uid], set(spans)) for uid in spans}
            if self.kernel is not None:
                row_slot = [-1] * num_rows
                for uid, ranges in spans.items():
                    for lo, hi in ranges:
                        row_slot[lo:hi] = [slots[uid]] * (hi - lo)
                step.row_slot = self.backend.to_device(row_slot, torch.int32)
            else:
                for uid, ranges in spans.items():
                    rows = (slice(*ranges[0]) if len(ranges) == 1 else
                            self.backend.to_device([r for lo, hi in ranges for r in range(lo, hi)]))
                    step.groups.append((slots[uid], rows))
        self.step = step
        self.model.lora_step = step
