"""A GGUF tensor's own quantized blocks in the one form the block kernels read: per block of
32 k of each row, w = d * q + m with q an unsigned byte (0..254), d and m float32.

Each type's values come out exactly as ggml (and the gguf package) dequantizes them:
- Q4_0, Q5_0, Q8_0: w = d * (s - offset) for stored s in 0..15 / 0..31, and Q8_0's signed
  s + 127 in 0..254, with m = -offset * d (offsets 8, 16 and 127: Q8_0's s is -127..127
  as llama.cpp quantizes; a block holding -128 cannot be kept);
- Q4_1, Q5_1: w = d * q + m as stored;
- Q4_K, Q5_K: super-blocks of 256 with a 6-bit scale and minimum per sub-block of 32:
  d = d_super * scale, m = -dmin_super * min, both exact in float32.
Q6_K's scales cover 16 k each, which no block of 32 holds exactly: it has a form of its
own (Q6KBlocks, decode_q6k: 6-bit q, an int8 scale per 16 k, a float scale per 256), which
backends/cpu/x86/q6k.cpp computes on. The 2- and 3-bit K-quants and the i-quants are not
decoded here; the loader requantizes such matrices to 8-bit blocks (quantize_8bit_blocks)
and says so.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

QK = 32
QK_K = 256
# ggml's type names whose blocks decode here.
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K")


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block -> 32 values: the low nibbles are elements 0..15, the high 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes per block -> bit j of the little-endian uint32 for element j."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")
    return bits.astype(np.uint8)


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 6-bit scales and minimums packed in a K-quant super-block's 12 bytes
    (ggml's get_scale_min_k4)."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), np.uint8)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


def _k_quant_values(qs: np.ndarray, qh: np.ndarray | None) -> np.ndarray:
    """Q4_K/Q5_K's 256 values per super-block: 4 chunks of 64, each 32 bytes whose low
    nibbles are the chunk's first 32 values, high nibbles its last 32; Q5_K's fifth bit of
    chunk j's first half is bit 2j of qh[l], of its second half bit 2j + 1."""
    n = qs.shape[0]
    qs = qs.reshape(n, 4, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [n, 4, 64]
    if qh is not None:
        for j in range(4):
            q[:, j, :32] |= ((qh >> (2 * j)) & 1) << 4
            q[:, j, 32:] |= ((qh >> (2 * j + 1)) & 1) << 4
    return q.reshape(n, QK_K)


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """raw: a 2-D tensor's bytes as stored (rows of whole blocks); shape: (rows, k).
    Returns (q [rows, k] uint8, d, m [rows, k / 32] float32) with d * q + m the values ggml
    dequantizes to, or None for a type (or block) this form cannot hold."""
    rows, k = shape
    b = np.ascontiguousarray(raw).reshape(-1)
    if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[type_name]
        blk = b.reshape(-1, size)
        d = _f16(blk[:, 0:2]).reshape(-1)
        if type_name == "Q8_0":
            qs = blk[:, 2:].view(np.int8)
            if (qs == -128).any():
                return None
            q = (qs.astype(np.int16) + 127).astype(np.uint8)
            m = -127.0 * d
        elif type_name == "Q4_0":
            q, m = _nibbles32(blk[:, 2:]), -8.0 * d
        elif type_name == "Q4_1":
            q, m = _nibbles32(blk[:, 4:]), _f16(blk[:, 2:4]).reshape(-1)
        elif type_name == "Q5_0":
            q = _nibbles32(blk[:, 6:]) | (_high_bits32(blk[:, 2:6]) << 4)
            m = -16.0 * d
        else:
            q = _nibbles32(blk[:, 8:]) | (_high_bits32(blk[:, 4:8]) << 4)
            m = _f16(blk[:, 2:4]).reshape(-1)
        return (q.reshape(rows, k).astype(np.uint8), d.reshape(rows, k // QK).astype(np.float32),
                np.asarray(m, np.float32).reshape(rows, k // QK))
    if type_name in ("Q4_K", "Q5_K"):
        size = 144 if type_name == "Q4_K" else 176
        blk = b.reshape(-1, size)
        dsup, dmin = _f16(blk[:, 0:2]), _f16(blk[:, 2:4])           # [n, 1]
        sc, mn = _scale_min_k4(blk[:, 4:16])                          # [n, 8]
        if type_name == "Q4_K":
            q = _k_quant_values(blk[:, 16:], None)
        else:
            q = _k_quant_values(blk[:, 48:], blk[:, 16:48])
        d = dsup * sc.astype(np.float32)
        m = -(dmin * mn.astype(np.float32))
        return (q.reshape(rows, k).astype(np.uint8), d.reshape(rows, k // QK).astype(np.float32),
                m.reshape(rows, k // QK).astype(np.float32))
    return None


class Q6KBlocks(NamedTuple):
    """A Q6_K matrix as stored, rows in the model's order: w = d * sc * (q - 32) per element,
    with q [rows, k] uint8 in 0..63, sc [rows, k / 16] int8 (one per 16 k) and d
    [rows, k / 256] float32 (one per super-block)."""
    q: torch.Tensor
    sc: torch.Tensor
    d: torch.Tensor

    def values(self) -> torch.Tensor:
        """float32 [rows, k], as ggml computes them: (d * sc), exact in float32, times q - 32."""
        rows, k = self.q.shape
        dsc = self.d.repeat_interleave(QK_K // 16, dim=1) * self.sc.float()
        return (dsc.repeat_interleave(16, dim=1) * (self.q.float() - 32)).view(rows, k)


def decode_q6k(raw: np.ndarray, shape: tuple[int, int]) -> Q6KBlocks:
    """A Q6_K tensor's bytes (rows of whole super-blocks of 210 bytes: ql[128], qh[64],
    scales[16] int8, d float16) -> its Q6KBlocks, of numpy arrays (the loader makes them
    tensors). Within each half of 128 values, element 32 j + l (j in 0..3) has its low 4
    bits in ql[l + 32 (j % 2)] (the low nibble for j < 2, the high one after) and its top
    two in bits 2j..2j+1 of qh[l] (ggml's dequantize_row_q6_K)."""
    rows, k = shape
    blk = np.ascontiguousarray(raw).reshape(-1, 210)
    n = blk.shape[0]
    ql = blk[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    ql = (ql & 0x0F).reshape(n, 2, 4, 32)
    qh = blk[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ql | ((qh & 0x03) << 4)
    sc = blk[:, 192:208].view(np.int8)
    d = _f16(blk[:, 208:210])
    return Q6KBlocks(q.reshape(rows, k).astype(np.uint8), np.ascontiguousarray(sc).reshape(rows, k // 16),
                     d.reshape(rows, k // QK_K).astype(np.float32))


def blocks_of(blocks) -> torch.Tensor:
    """The float32 values of a matrix's blocks in either form (Q6KBlocks or (q, d, m))."""
    return blocks.values() if isinstance(blocks, Q6KBlocks) else blocks_values(*blocks)


def quantize_8bit_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Symmetric 8-bit per block of 32 k (Q8_0's rounding) in the same form, for matrices
    whose own type has none (Q6_K, float): q + 127 in 0..254, d = max|w| / 127, m = -127 d.
    K is padded to whole blocks."""
    w = weight.detach().float()
    n, k = w.shape
    nblk = -(-k // QK)
    wp = torch.nn.functional.pad(w, (0, nblk * QK - k)).view(n, nblk, QK)
    d = wp.abs().amax(dim=2) / 127
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round(wp / safe[..., None]).clamp(-127, 127) + 127
    return q.view(n, -1)[:, :k].to(torch.uint8).contiguous(), d, -127 * d


def blocks_values(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """d * q + m per block of 32, float32 [rows, k]: the values blocks hold."""
    rows, k = q.shape
    nblk = d.shape[1]
    qb = torch.nn.functional.pad(q.float(), (0, nblk * QK - k)).view(rows, nblk, QK)
    return (qb * d[..., None] + m[..., None]).view(rows, -1)[:, :k]
