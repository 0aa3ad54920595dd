"""Q6_K matrices two ways, side by side: in their own form (backends/cpu/x86/q6k.cpp, 6-bit
q and int8 scales per 16 k, what `--quantization gguf` runs) and requantized to 8-bit
blocks of 32 from their exact values (the wide w4a8 form, what it ran before). Random
Q6_K blocks of each shape (Gemma 3 270M's ffn_down, 640 x 2048; a Llama 3 8B's, 4096 x
14336), bf16 activations of 1, 8 and 32 rows; the two forms alternate, median of --repeats
rounds of --calls calls each. Prints one JSON line per shape and rows: ms per call, bytes
each form keeps, and the 8-bit form's relative RMS error against the file's values.

    python benchmarks/q6k_linear.py [--cpu-isa avx512] [--rows 1,8,32] [--repeats 5]
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

SHAPES = {"gemma3-270m ffn_down": (640, 2048), "llama3-8b ffn_down": (4096, 14336)}


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
    for shape_name, (n, kdim) in SHAPES.items():
        q6 = random_q6k(n, kdim)
        exact = q6.values()
        low, top, sc, d = k.q6k_pack_weight(q6.q, q6.sc, q6.d)
        q8 = quantize_8bit_blocks(exact)
        wide = k.w4a8_pack_weight(q8[0], q8[1], -127 * torch.ones(n))
        rel_rms = ((blocks_values(*q8) - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
        own_bytes = sum(t.numel() * t.element_size() for t in (low, top, sc, d))
        wide_bytes = sum(t.numel() * t.element_size() for t in wide)
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, kdim).to(torch.bfloat16)
            runs = {"q6k": lambda: k.w4a8_linear(x, low, d, sc, n, None, False, top),
                    "8bit": lambda: k.w4a8_linear(x, *wide, n, None, False)}
            times = {name: [] for name in runs}
            for name, fn in runs.items():  # warm-up
                time_calls(fn, 3)
            for _ in range(args.repeats):
                for name, fn in runs.items():
                    times[name].append(time_calls(fn, args.calls))
            med = {name: statistics.median(v) for name, v in times.items()}
            print(json.dumps({"shape": shape_name, "n": n, "k": kdim, "rows": m, "isa": args.cpu_isa or "best",
                              "q6k_ms": round(med["q6k"], 4), "8bit_ms": round(med["8bit"], 4),
                              "q6k_mb": round(own_bytes / 1e6, 2), "8bit_mb": round(wide_bytes / 1e6, 2),
                              "8bit_rel_rms_error": round(rel_rms, 5)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
