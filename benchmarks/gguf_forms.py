"""A GGUF's quantized matrices in the forms `--quantization gguf` keeps them, each beside
the form it replaced, side by side:
- Q6_K in its own form (backends/cpu/x86/q6k.cpp: 6-bit q, int8 scales per 16 k) against
  the same matrix requantized to 8-bit blocks of 32 from its exact values;
- 5-bit blocks (Q5_0, Q5_1, Q5_K: w4a8_pack_5bit, 5 bits a weight) against the same
  blocks a byte a weight (the wide form), which give the same bits.
Random blocks of Gemma 3 270M's shapes (Q6_K ffn_down 640 x 2048, Q5_0 ffn_up 2048 x 640)
and a Llama 3 8B's (4096 x 14336, 14336 x 4096), bf16 activations of 1, 8 and 32 rows; the
two forms alternate, median of --repeats rounds of --calls calls each. Prints one JSON line
per matrix and rows: ms per call, MB each form keeps, and the replaced form's relative RMS
error against the file's values.

    python benchmarks/gguf_forms.py [--cpu-isa avx512] [--rows 1,8,32] [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

Q6K_SHAPES = {"gemma3-270m ffn_down": (640, 2048), "llama3-8b ffn_down": (4096, 14336)}
Q5_SHAPES = {"gemma3-270m ffn_up": (2048, 640), "llama3-8b ffn_up": (14336, 4096)}


def random_q6k(n: int, k: int, seed: int = 0):
    """Random Q6_K super-blocks (every bit pattern of q and the scales is valid) with float16
    d small enough for weights of a trained layer's size."""
    from sluice.quantization.gguf_blocks import Q6KBlocks, decode_q6k
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n * k // 256, 210), dtype=np.uint8)
    raw[:, 208:210] = rng.uniform(2e-5, 1e-4, len(raw)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return Q6KBlocks(*map(torch.from_numpy, decode_q6k(raw, (n, k))))


def time_calls(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu-isa", default=None, help="kernel build (default: the CPU's best)")
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    from sluice.backends.cpu import x86
    from sluice.quantization.gguf_blocks import blocks_values, quantize_8bit_blocks
    k = x86.load(args.cpu_isa)
    if k is None:
        print("no kernel build here", file=sys.stderr)
        return 1
    def compare(label, name, n, kdim, new, old, new_mb, old_mb, rel_rms):
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, kdim).to(torch.bfloat16)
            runs = {"new": lambda: new(x), "old": lambda: old(x)}
            times = {key: [] for key in runs}
            for fn in runs.values():  # warm-up
                time_calls(fn, 3)
            for _ in range(args.repeats):
                for key, fn in runs.items():
                    times[key].append(time_calls(fn, args.calls))
            med = {key: statistics.median(v) for key, v in times.items()}
            print(json.dumps({"type": label, "shape": name, "n": n, "k": kdim, "rows": m,
                              "isa": args.cpu_isa or "best", "new_ms": round(med["new"], 4),
                              "old_ms": round(med["old"], 4), "new_mb": round(new_mb / 1e6, 2),
                              "old_mb": round(old_mb / 1e6, 2), "old_rel_rms_error": round(rel_rms, 5)}), flush=True)

    def nbytes(ts):
        return sum(t.numel() * t.element_size() for t in ts)

    for name, (n, kdim) in Q6K_SHAPES.items():  # new: Q6_K's own form; old: 8-bit blocks
        q6 = random_q6k(n, kdim)
        exact = q6.values()
        own = k.q6k_pack_weight(q6.q, q6.sc, q6.d)
        q8 = quantize_8bit_blocks(exact)
        wide = k.w4a8_pack_weight(q8[0], q8[1], -127 * torch.ones(n))
        rel_rms = ((blocks_values(*q8) - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
        low, top, sc, d = own
        compare("Q6_K", name, n, kdim, lambda x: k.w4a8_linear(x, low, d, sc, n, None, False, top),
                lambda x: k.w4a8_linear(x, *wide, n, None, False), nbytes(own), nbytes(wide), rel_rms)
    for name, (n, kdim) in Q5_SHAPES.items():  # new: 5 bits a weight; old: a byte (the same values)
        g = torch.Generator().manual_seed(n)
        q = torch.randint(0, 32, (n, kdim), generator=g, dtype=torch.uint8)
        d = torch.rand(n, kdim // 32, generator=g) * 1e-3
        five = k.w4a8_pack_5bit(q, d, torch.full((n,), -16.0))
        wide = k.w4a8_pack_weight(q, d, torch.full((n,), -16.0))
        compare("Q5_0", name, n, kdim, lambda x: k.w4a8_linear(x, *five, n, None, False),
                lambda x: k.w4a8_linear(x, *wide, n, None, False), nbytes(five), nbytes(wide), 0.0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
