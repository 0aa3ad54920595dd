"""fp8: e4m3 weights with a float32 scale per output channel, activations quantized per
token when a step runs (backends/cuda/fp8.py), the products on FP8 tensor cores
(torch._scaled_mm) or, at a few rows, the split-K GEMV that reads the FP8 weights
(backends/cuda/gemv.py). Half the bytes of bf16 weights: at decode batch sizes, where a
step reads every weight once, about half the time.

The layer keeps only its FP8 form (`module.fp8_weight`, `module.fp8_scale`); the bf16
weight is released once quantized, so an FP8 model holds ~1 byte a weight. A weight update
writes new rows through `module.write_rows`, which quantizes them as a load would (each
row has its own scale, so new rows give what quantizing the whole new weight would).

A checkpoint that already carries FP8 weights and scales (quantization_config
`quant_method: "fp8"`, or compressed-tensors float8; models/loader.py reads them) keeps
its own values: `module.source_fp8` holds them per part of a fused layer, a per-tensor
scale becoming that part's rows' scale, so nothing is rounded twice.

The LM head, the embedding and a mixture of experts' router stay in the model's dtype
(as in vLLM's FP8: the head's error shows directly in the logits).
"""
from __future__ import annotations

import torch

from sluice.models.linear import Linear, release_weight
from sluice.quantization.base import QuantizationScheme

E4M3_MAX = 448.0
FP8 = torch.float8_e4m3fn
# A group whose values are all zero gets this absolute maximum (its q are 0, its scale tiny).
TINY = 1e-12


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 per row (a weight's output channel at load; the kernels' reference for a token's
    activations or K/V): scale = max|x| / 448 and q = e4m3(x * (448 / max|x|)), rounded half
    to even and saturating at +-448, as backends/cuda/fp8.e4m3_round rounds in a kernel."""
    xf = x.float()
    top = xf.abs().amax(-1, keepdim=True).clamp(min=TINY)
    # 448 / top as one division (a Python number over a tensor is a reciprocal times the
    # number in torch: another rounding), as the kernel computes it.
    q = (xf * (torch.full_like(top, E4M3_MAX) / top)).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)
    return q, (top / E4M3_MAX).squeeze(-1)


def check_scales(scale: torch.Tensor, what: str) -> None:
    """FP8 scales must be finite and > 0 (a checkpoint's, or ours)."""
    if not bool(torch.isfinite(scale).all()) or not bool((scale > 0).all()):
        raise ValueError(f"{what}: FP8 scales must be finite and > 0")


def fp8_layers(model) -> list[tuple[str, Linear]]:
    """The layers the scheme quantizes: every Linear but the LM head and routers."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, Linear) and not name.startswith("lm_head") and not name.endswith(".gate")]


class Fp8(QuantizationScheme):
    name = "fp8"
    families = ("cuda",)
    needs_kernels = False
    keeps_weights = False
    takes_updates = True

    @torch.no_grad()
    def quantize_rows(self, module: Linear, start: int = 0, rows: int | None = None) -> None:
        """Quantize rows [start, start + rows) of the layer (all by default) from its weight,
        or from the checkpoint's own FP8 values where it carried them."""
        w = module.weight
        n, k = w.shape
        rows = n - start if rows is None else rows
        if getattr(module, "fp8_weight", None) is None:
            module.fp8_weight = torch.empty((n, k), dtype=FP8, device=w.device)
            module.fp8_scale = torch.empty((n,), dtype=torch.float32, device=w.device)
        source = getattr(module, "source_fp8", None) or {}
        taken = []
        for offset, (q, scale) in sorted(source.items()):
            if start <= offset and offset + q.shape[0] <= start + rows:
                module.fp8_weight[offset:offset + q.shape[0]] = q.to(w.device)
                module.fp8_scale[offset:offset + q.shape[0]] = scale.to(w.device)
                taken.append((offset, offset + q.shape[0]))
        at = start
        for lo, hi in taken + [(start + rows, start + rows)]:
            if lo > at:
                self._write(module, at, w[at:lo])
            at = max(at, hi)
        module.source_fp8 = None

    def _write(self, module: Linear, start: int, values: torch.Tensor) -> None:
        q, scale = quantize_rows_reference(values)
        module.fp8_weight[start:start + values.shape[0]] = q
        module.fp8_scale[start:start + values.shape[0]] = scale

    @torch.no_grad()
    def release(self, module: Linear) -> None:
        """Drop the bf16 weight (a meta tensor keeps its shape); new rows come through
        write_rows."""
        release_weight(module)
        module.write_rows = lambda start, values: self._write(module, start, values)


FP8_SCHEME = Fp8()
