"""Linear and Embedding: the torch layers whose computation the backend may replace.

After loading, the backend's prepare() may set `method`, a callable `method(x, bias)` (on
the CPU backends/cpu/linear.py: our kernels, int8 weights, a oneDNN prepacked weight); the
layer itself knows nothing of the hardware.

A row-parallel layer (tensor parallelism, distributed/parallel.py) holds a slice of the
input features; `reduce` is the group whose all-reduce sums the ranks' partial outputs,
and only rank 0 adds the bias, so that it is added once.

`lora`, where adapters are served (lora/slots.py), adds each adapter's B @ (A @ x) to the
rows of the step that use it, after the base product.

Embedding's `method(ids)`, where set, reads the rows from the backend's own copy of the
table (a GGUF's quantized blocks, shared with a tied LM head: quantization/gguf.py).

Built inside `building_weights(dtype, unallocated)`, both layers' weights are made in the
model's dtype at once (built in float32 and then converted, a model's build needed 4 bytes
a parameter: 32 GB for an 8B model, whatever its load then kept), and the kinds named in
`unallocated` get meta weights (shape and dtype, no memory): for a load that hands the
weights over in another form (a GGUF's own blocks, `model.load_weights` with
`tensor.gguf_blocks`), so a model bigger than memory in bf16 never needs its bf16 size at
load.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn


_unallocated: frozenset[str] = frozenset()   # "linear", "embedding": which layers get meta weights
_dtype: torch.dtype | None = None             # their parameters' dtype (None: torch's default)


@contextmanager
def building_weights(dtype: torch.dtype | None = None, unallocated: Iterable[str] = ()):
    """Linear and Embedding layers built in this block: parameters in `dtype`, and meta
    weights (biases as usual) for the kinds in `unallocated` ("linear", "embedding")."""
    global _unallocated, _dtype
    saved = _unallocated, _dtype
    _unallocated, _dtype = frozenset(unallocated), dtype
    try:
        yield
    finally:
        _unallocated, _dtype = saved


@torch.no_grad()
def allocate_weight(layer: nn.Module, device: torch.device | str) -> None:
    """Give a layer built without a weight (building_weights) one, of zeros on `device`, for
    a load that writes its values after all."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.zeros(w.shape, dtype=w.dtype, device=device), requires_grad=False)


@torch.no_grad()
def release_weight(layer: nn.Module) -> None:
    """Drop a layer's weight once another form holds its values (packed blocks, a packed
    copy): a meta tensor keeps its shape and dtype, and anything that still read it would
    fail loudly instead of computing with stale values."""
    w = layer.weight
    layer.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), requires_grad=False)


@torch.no_grad()
def _zero_init(layer: nn.Module) -> None:
    """Zeros where torch's layers draw random initial values: every weight is then written
    by the checkpoint's load (which refuses a checkpoint missing any) or by dummy_weights,
    and drawing them took longer than loading them (2 s of Gemma 3 270M's start)."""
    for p in layer.parameters(recurse=False):
        p.zero_()


class Linear(nn.Linear):
    method = None  # set by the backend; None: F.linear on the weight as loaded
    reduce = None  # row-parallel: the tensor-parallel group (TPGroup) to all-reduce over
    lora = None    # with LoRA adapters served: its slots (lora/slots.py LoRALayer), called as lora(x, y)

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        if "linear" not in _unallocated:
            super().__init__(in_features, out_features, bias, dtype=_dtype)
            return
        super().__init__(in_features, out_features, False, device="meta", dtype=_dtype)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=_dtype)) if bias else None

    def reset_parameters(self) -> None:
        _zero_init(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if self.reduce is None or self.reduce.rank == 0 else None
        y = self.method(x, bias) if self.method is not None else F.linear(x, self.weight, bias)
        if self.reduce is not None:
            self.reduce.all_reduce(y)
            y = y.to(x.dtype)  # the backend's method may give float32 partial sums
        if self.lora is not None:
            y = self.lora(x, y)
        return y


class Embedding(nn.Embedding):
    method = None  # set by the backend; None: the table as loaded

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__(num_embeddings, embedding_dim, device="meta" if "embedding" in _unallocated else None,
                         dtype=_dtype)

    def reset_parameters(self) -> None:
        _zero_init(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method(ids) if self.method is not None else super().forward(ids)
