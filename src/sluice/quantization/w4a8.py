"""w4a8: 4-bit weights in llama.cpp's Q4_1 form (a scale and a minimum per block of 32:
a Q4_1 GGUF's own blocks as the file stores them, else fitted to the bf16 weights) times
the int8 activations of w8a8 (backends/cpu/x86/w4a8.cpp), at every row count: the fastest
batches on AVX2 CPUs without VNNI. Its end layers (base.end_layers) multiply the 4-bit
weights' values in bf16.

A layer releases its bf16 weight once packed: the weight would be 2 bytes a parameter,
never read again (SmolLM2's layers: 212 MB; an 8B model's ~16 GB). Its 4-bit form
(`module.w4`, FourBit: what the kernels pack, and what an update's new rows are fitted
into) is dropped too once packed, 0.75 bytes a parameter (a 1B model's 0.7 GB): the packed
copy holds the same q, d and m, and an update unpacks them again (unpack_4bit) before its
new rows are written; only the end layers, whose packed copy is of bf16 values, keep it.
New rows come through `module.write_rows`, as FP8's do. From a Q4_1 GGUF (in one
process) the layers are built without a weight at all and take the file's blocks as their
form (worker/shard.py), so the load never holds the bf16 model either."""
from __future__ import annotations

from typing import NamedTuple

import torch

from sluice.models.linear import Linear, release_weight
from sluice.quantization.base import QuantizationScheme, end_layers, weight_read_directly

BLOCK_4BIT = 32


def quantize_4bit(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """llama.cpp's Q4_1 per block of 32 k of each row: w ~= d * q + m with q in 0..15, m
    the block's minimum and d = (max - m) / 15. Returns (q [N, K] uint8, d, m [N, ceil(K /
    32)] float32). On the values of a Q4_1 tensor (a Q4_1 GGUF loaded in bf16) it finds
    the stored q again: each value is within bf16 rounding of d * q + m, far under d / 2."""
    w = weight.detach().float()
    n, k = w.shape
    kp = -(-k // BLOCK_4BIT) * BLOCK_4BIT
    valid = torch.arange(kp) < k
    wp = torch.nn.functional.pad(w, (0, kp - k)).view(n, kp // BLOCK_4BIT, BLOCK_4BIT)
    valid = valid.view(1, kp // BLOCK_4BIT, BLOCK_4BIT)
    mn = torch.where(valid, wp, torch.inf).amin(dim=2)
    mx = torch.where(valid, wp, -torch.inf).amax(dim=2)
    d = (mx - mn) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((wp - mn[..., None]) / safe[..., None]).clamp(0, 15)
    q = torch.where(valid & (d[..., None] > 0), q, torch.zeros_like(q))
    return q.view(n, kp)[:, :k].to(torch.uint8).contiguous(), d, mn


def dequantize_4bit(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """quantize_4bit's values back: d * q + m per block of 32, float32 [N, K]."""
    n, k = q.shape
    nblk = d.shape[1]
    qb = torch.nn.functional.pad(q.float(), (0, nblk * BLOCK_4BIT - k)).view(n, nblk, BLOCK_4BIT)
    return (qb * d[..., None] + m[..., None]).view(n, -1)[:, :k]


class FourBit(NamedTuple):
    """A layer's 4-bit form as it keeps it: q two to a byte (an even k in the low nibble),
    half the bytes of one q a byte (the kernels pack their own layouts from unpacked())."""
    nibbles: torch.Tensor  # [N, ceil(K / 2)] uint8
    d: torch.Tensor        # [N, ceil(K / 32)] float32
    m: torch.Tensor
    k: int

    @staticmethod
    def zeros(n: int, k: int) -> FourBit:
        nblk = -(-k // BLOCK_4BIT)
        return FourBit(torch.zeros(n, -(-k // 2), dtype=torch.uint8), torch.zeros(n, nblk), torch.zeros(n, nblk), k)

    def write(self, start: int, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> None:
        """Rows [start, start + len(q)) from quantize_4bit's (q, d, m)."""
        q = torch.nn.functional.pad(q, (0, q.shape[1] % 2))
        self.nibbles[start:start + q.shape[0]] = q[:, 0::2] | (q[:, 1::2] << 4)
        self.d[start:start + q.shape[0]] = d
        self.m[start:start + q.shape[0]] = m

    @staticmethod
    def of(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> FourBit:
        """The whole layer from quantize_4bit's (q, d, m)."""
        four = FourBit.zeros(*q.shape)
        four.write(0, q, d, m)
        return four

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q [N, K] uint8, d, m), quantize_4bit's form."""
        n = self.nibbles.shape[0]
        q = torch.stack((self.nibbles & 15, self.nibbles >> 4), dim=2).view(n, -1)[:, :self.k]
        return q.contiguous(), self.d, self.m


@torch.no_grad()
def quantize_rows_4bit(module: Linear, start: int = 0, rows: int | None = None) -> None:
    """quantize_rows' 4-bit counterpart: rows [start, start + rows) of a Linear's weight to
    quantize_4bit's form, in place (the weight keeps their dequantized values), and into
    `module.w4` (FourBit), what the w4a8 kernels pack. Rows are independent."""
    rows = module.weight.shape[0] - start if rows is None else rows
    w = module.weight.narrow(0, start, rows)
    own = _file_blocks(module) if start == 0 and rows == module.weight.shape[0] else None
    q, d, m = own if own is not None else quantize_4bit(w)
    w.copy_(dequantize_4bit(q, d, m).to(w.dtype))
    if getattr(module, "w4", None) is None:
        module.w4 = FourBit.zeros(*module.weight.shape)
    module.w4.write(start, q, d, m)


@torch.no_grad()
def write_rows_4bit(module: Linear, start: int, values: torch.Tensor) -> None:
    """New rows [start, start + len(values)) of a layer whose weight is released: fitted as
    quantize_rows_4bit fits them (rows are independent, so as a fresh load of them would
    be), into `module.w4`, unpacked again from the packed copy by the update's first rows."""
    if getattr(module, "w4", None) is None:
        module.w4 = unpack_4bit(module.method, *module.weight.shape)
    module.w4.write(start, *quantize_4bit(values))


def unpack_4bit(method, n: int, k: int) -> FourBit:
    """A layer's 4-bit form from its packed copy (backends/cpu/linear.py KernelWeight, as
    kernel_weight packs w4a8): the byte layout [N/16, K/4, 16, 4] where it was kept, else the
    nibbles (two 4-k steps a byte: the even step low), and the block scales and minimums
    [N/16, nblk, 16] (float32, or float16 holding the same values)."""
    steps = method.w4a8
    if steps is None or steps.numel() == 0:
        nib = method.w4nib
        steps = torch.stack((nib & 15, nib >> 4), dim=2).view(nib.shape[0], -1, *nib.shape[2:])
    if steps.dtype != torch.uint8 or method.w4m.dtype == torch.int8:
        raise ValueError("not a w4a8 layer's packed 4-bit weights")
    nb, ks, lanes, per = steps.shape
    q = steps.permute(0, 2, 1, 3).reshape(nb * lanes, ks * per)[:n, :k]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.float().permute(0, 2, 1).reshape(nb * lanes, t.shape[1])[:n]
    return FourBit.of(q, rows(method.w4d), rows(method.w4m))


def _file_blocks(module: Linear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """A Q4_1 GGUF's own blocks of the whole layer (the loader's `source_blocks`: first row
    -> (q, d, m), each part of a fused layer at its offset), else None. Their float16 d and
    m are the file's exactly, where refitting them from the bf16 weights is off by up to a
    bf16 rounding; as float16 values the kernels read them two bytes each
    (w4a8_half_scales). Taken once: a later weight update refits its rows."""
    parts = getattr(module, "source_blocks", None) or {}
    module.source_blocks = None
    n, k = module.weight.shape
    at, qs, ds, ms = 0, [], [], []
    for start in sorted(parts):
        part = parts[start]
        if start != at or not isinstance(part, tuple) or len(part) != 3:
            return None
        q, d, m = part
        if q.dtype != torch.uint8 or q.dim() != 2 or q.shape[1] != k or int(q.max()) > 15 \
                or d.shape != (q.shape[0], -(-k // BLOCK_4BIT)) or m.shape != d.shape:
            return None
        qs.append(q), ds.append(d.float()), ms.append(m.float())
        at += q.shape[0]
    if at != n:
        return None
    return torch.cat(qs).contiguous(), torch.cat(ds).contiguous(), torch.cat(ms).contiguous()


class W4A8(QuantizationScheme):
    name = "w4a8"
    keeps_weights = False

    def quantize_rows(self, module, start=0, rows=None):
        if module.weight.device.type != "meta":
            quantize_rows_4bit(module, start, rows)
        elif getattr(module, "w4", None) is None:
            # Built without a weight (a Q4_1 GGUF's load, worker/shard.py): the file's blocks
            # are its form as they are.
            own = _file_blocks(module)
            if own is None:
                raise ValueError("a w4a8 layer built without a weight takes a Q4_1 GGUF's blocks of the whole layer")
            module.w4 = FourBit.of(*own)
        # else released after its load: write_rows fitted the new rows

    def kernel_method(self, kernels, model, name, module, dtype, deterministic):
        from sluice.backends.cpu.linear import kernel_weight
        end = name.startswith(end_layers(model))
        weight = module.weight
        if end and weight.device.type == "meta":  # an update of a released end layer: its values again
            weight = dequantize_4bit(*module.w4.unpacked()).to(weight.dtype)
        method = kernel_weight(kernels, weight, None, deterministic, w4=None if end else module.w4.unpacked())
        if not weight_read_directly(name):
            release_weight(module)
            module.write_rows = lambda start, values: write_rows_4bit(module, start, values)
            if not end:  # the packed copy holds it (unpack_4bit)
                module.w4 = None
        return method


W4A8_SCHEME = W4A8()
