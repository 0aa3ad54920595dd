"""gguf: a GGUF's quantized weights multiplied in the file's own blocks, as llama.cpp does,
instead of dequantized to bf16 (3-4x the bytes in memory and per decode step).

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q5_K tensors come from the loader as their own
blocks (quantization/gguf_blocks.py: per block of 32, w = d * q + m, exactly the values
ggml dequantizes to) into the w4a8 kernel family (backends/cpu/x86/w4a8.cpp: 4-bit q in
nibbles, 5-bit q in nibbles and a plane of fifth bits, wider q a byte each) times int8
activations per block of 32, as ggml's own CPU dot products quantize activations to Q8_0.
Every layer, the LM head included: the file's precision is the model's. Q6_K, whose scales
cover 16 k, has a kernel of its own (backends/cpu/x86/q6k.cpp: 6-bit q, its int8 scales
per 16 k) for a layer whose rows are all one Q6_K tensor; where a fused layer joins Q6_K
rows to other types (a Q4_K_M file's attn_v beside Q4_K q and k), those rows are
requantized to 8-bit blocks of 32 from their exact values (error at most max|w| / 254 per
block), as are tensors of the types no kernel here reads (float matrices, the 2- and 3-bit
K-quants), which the loader's log line names.

The embedding table is read from the same packed blocks as the tied LM head (no second
copy), and 4-bit weights keep only their nibbles on every build (the AVX2 builds' byte
layout, faster from 8 rows there, would double their bytes). From a GGUF the linear and
embedding weights are never allocated in the model dtype (models/linear.py,
building_weights; worker/shard.py); a model of another source is loaded in bf16 and its
weights released after packing. Either way no dequantized weights remain, so this scheme
cannot take weight updates (LLMEngine.update_weights refuses them).
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from sluice.models.linear import Linear, release_weight
from sluice.quantization.base import QuantizationScheme
from sluice.quantization.gguf_blocks import QK, Q6KBlocks, quantize_8bit_blocks

logger = logging.getLogger(__name__)


def _symmetric_offset(d: torch.Tensor, m: torch.Tensor) -> float | None:
    """The offset o with m == -o * d in every block (Q8_0's 127, Q5_0's 16, Q4_0's 8, as
    decode_blocks and quantize_8bit_blocks compute them), else None."""
    for o in (127.0, 16.0, 8.0):
        if torch.equal(m, -o * d):
            return o
    return None


def q6k_form(module: nn.Module) -> Q6KBlocks | None:
    """The layer's Q6_K blocks where one Q6_K tensor gave all its rows, else None."""
    parts = getattr(module, "source_blocks", None) or {}
    only = parts.get(0) if len(parts) == 1 else None
    if isinstance(only, Q6KBlocks) and only.q.shape == tuple(module.weight.shape):
        return only
    return None


def pack_blocks(kernels, module: nn.Module, deterministic: bool):
    """The layer's KernelWeight: Q6_K's own kernel where one Q6_K tensor gave all its rows,
    else the block form (source_form), 4-bit weights as nibbles only."""
    from sluice.backends.cpu.linear import kernel_weight
    q6k = q6k_form(module)
    if q6k is not None:
        return kernel_weight(kernels, module.weight, None, deterministic, q6k=q6k)
    return kernel_weight(kernels, module.weight, None, deterministic, w4=source_form(module), nibbles_only=True)


def source_form(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) of the whole weight: the file's blocks where the loader kept them
    (`module.source_blocks`: first row -> (q, d, m)), 8-bit blocks of the loaded values
    for rows it did not (and of a Q6_K part's values). Where the weights are wide (q past
    15) and every row symmetric, m is one -offset per row [N] instead of one minimum per
    block (w4a8.cpp computes each block's as d times it: a quarter of the bytes of the
    8-bit form not stored)."""
    weight = module.weight
    n, k = weight.shape
    nblk = -(-k // QK)
    q = torch.empty(n, k, dtype=torch.uint8)
    d, m = torch.empty(n, nblk), torch.empty(n, nblk)
    offsets = torch.full((n,), 127.0)  # the 8-bit blocks' (quantize_8bit_blocks)
    symmetric = True
    covered = torch.zeros(n, dtype=torch.bool)
    for start, part in (getattr(module, "source_blocks", None) or {}).items():
        bq, bd, bm = quantize_8bit_blocks(part.values()) if isinstance(part, Q6KBlocks) else part
        rows = bq.shape[0]
        q[start:start + rows], d[start:start + rows], m[start:start + rows] = bq, bd, bm
        covered[start:start + rows] = True
        offset = _symmetric_offset(bd, bm)
        symmetric = symmetric and offset is not None
        offsets[start:start + rows] = offset or 0.0
    if not covered.all():
        if weight.device.type == "meta":
            raise ValueError(f"a layer of shape {tuple(weight.shape)} has neither quantized blocks nor weights")
        missing = (~covered).nonzero().flatten()
        q[missing], d[missing], m[missing] = quantize_8bit_blocks(weight.detach()[missing])
    if symmetric and int(q.max()) > 15:
        return q, d, -offsets
    return q, d, m


def release_blocks_layer(module: nn.Module) -> None:
    """Drop the dequantized weight (the packed blocks are what the layer computes with) and
    the file's blocks it was packed from."""
    release_weight(module)
    module.source_blocks = None


class BlockRows:
    """An embedding table read from packed blocks (kernels.w4a8_rows), in the model dtype."""

    def __init__(self, kernels, method, k: int, dtype: torch.dtype):
        self.kernels, self.method, self.k, self.dtype = kernels, method, k, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.method
        rows = self.kernels.w4a8_rows(ids.reshape(-1).long(), w.w4a8, w.w4d, w.w4m, self.k, w.w4nib)
        return rows.to(self.dtype).view(*ids.shape, self.k)


class GGUF(QuantizationScheme):
    name = "gguf"
    keeps_weights = False
    takes_updates = False

    def quantize_rows(self, module, start=0, rows=None):
        # The form is taken when the layer is packed (kernel_method): the file's blocks for
        # the rows that have them. New rows would need the released weights: update_weights
        # is refused before it gets here.
        if start != 0 or (rows is not None and rows != module.weight.shape[0]):
            raise ValueError("quantization='gguf' keeps the file's blocks and cannot requantize rows")

    def kernel_method(self, kernels, model, name, module: Linear, dtype, deterministic):
        parts = (getattr(module, "source_blocks", None) or {}).values()
        if q6k_form(module) is None and any(isinstance(p, Q6KBlocks) for p in parts):
            model.gguf_q6k_fused = getattr(model, "gguf_q6k_fused", 0) + 1  # said once, in embedding_and_head
        method = pack_blocks(kernels, module, deterministic)
        release_blocks_layer(module)
        return method

    def embedding_and_head(self, kernels, model, dtype, deterministic):
        """Pack the embedding table (the tied head's weights too) and read the embedding's
        rows from it; returns the tied head's method, or None for an untied model."""
        if getattr(model, "gguf_q6k_fused", 0):
            logger.info("quantization='gguf': %d fused layers join Q6_K rows to other types; those rows run as "
                        "8-bit blocks of their exact values", model.gguf_q6k_fused)
        emb = model.model.embed_tokens
        method = pack_blocks(kernels, emb, deterministic)
        emb.method = BlockRows(kernels, method, emb.weight.shape[1], dtype)
        release_blocks_layer(emb)
        return method if model.lm_head is None else None


GGUF_SCHEME = GGUF()
