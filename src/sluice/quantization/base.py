"""What a quantization scheme is: how it quantizes a Linear's weight (at load, and the rows
a weight update writes), and what each backend multiplies by for it.

A scheme keeps the layer's weight as its dequantized values (what the layer computes with,
and what a fresh load of new weights would give) and its own packed form beside it
(`module.int8_scale`), or keeps only its own form and releases the weight once packed
(`keeps_weights = False`: w4a8's `module.w4`, gguf's blocks, FP8), new rows then coming
through `module.write_rows`. Backends ask it for a layer's method; a family whose
kernels cannot run it is refused by backends/select.py before anything loads, naming what
does run there (`families`, `needs_kernels`).
"""
from __future__ import annotations

import torch

from sluice.models.linear import Linear


def end_layers(model) -> tuple[str, ...]:
    """Name prefixes of the layers that keep finer activations under the schemes that
    quantize activations: the LM head and the first and last decoder layers (measured on
    SmolLM2: int8 activations there took the KL divergence from float32 from 0.0054 to
    0.0063 and flipped the answer to "What is the capital of France?", for ~1% of the
    speed)."""
    last = len(model.model.layers) - 1
    return ("lm_head", "model.layers.0.", f"model.layers.{last}.")


def weight_read_directly(name: str) -> bool:
    """Linear layers whose weight is read as a tensor, not only through their method, so a
    backend keeps it: the LM head's (the greedy head's int8 copy and the logits' fallback
    are made from it, models/llama.py head_weight) and a MoE router's gate (models/moe.py
    multiplies it itself)."""
    return name.startswith("lm_head") or name.endswith(".gate")


class QuantizationScheme:
    name = ""
    # The backend families with a kernel for it.
    families: tuple[str, ...] = ("cpu",)
    # On the CPU: only sluice's C++ kernels run it (not torch's own ops).
    needs_kernels = True
    # The layers keep their dequantized weights (what a weight update writes into).
    keeps_weights = True
    # A weight update can write new rows (into the kept weights, or through the layer's
    # `write_rows` where the scheme released them).
    takes_updates = True

    def quantize_rows(self, module: Linear, start: int = 0, rows: int | None = None) -> None:
        """Quantize rows [start, start + rows) of the layer's weight (all by default) in place."""
        raise NotImplementedError

    def kernel_method(self, kernels, model, name: str, module: Linear, dtype: torch.dtype, deterministic: bool):
        """The CPU kernels' method (backends/cpu/linear.py KernelWeight) for the layer."""
        raise NotImplementedError

    def embedding_and_head(self, kernels, model, dtype: torch.dtype, deterministic: bool):
        """Schemes that pack the embedding table: do so, and return the tied LM head's
        method (None: untied). The others keep the table as loaded (NotImplemented)."""
        return NotImplemented

    def torch_method(self, module: Linear, dtype: torch.dtype, packed):
        """The method on torch's own CPU ops (`packed`: the oneDNN prepacked weight, or None)."""
        raise ValueError(f"quantization={self.name!r} runs on sluice's C++ kernels only")
