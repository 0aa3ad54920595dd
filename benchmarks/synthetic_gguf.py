"""A GGUF of a Llama model's shape with random weights (sluice/bench/synthetic_gguf.py), for
measuring what a load costs at sizes that cannot be downloaded here (docs/benchmarks.md,
"Memory after a load").

    python benchmarks/synthetic_gguf.py /tmp/llama-1b-q4_1.gguf --hidden 2048 --layers 22 \\
        --ffn 5632 --heads 32 --kv-heads 4
    python benchmarks/load_memory.py --model /tmp/llama-1b-q4_1.gguf --modes auto
"""
from __future__ import annotations

import argparse

from sluice.bench.synthetic_gguf import write_synthetic_gguf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--type", default="Q4_1", choices=["Q4_1", "Q8_0"], help="the decoder linear weights' type")
    ap.add_argument("--untied", action="store_true", help="an output matrix of its own (Q8_0), not the embedding")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_synthetic_gguf(args.path, args.hidden, args.layers, args.ffn, args.heads, args.kv_heads, args.type,
                         args.untied, args.seed)


if __name__ == "__main__":
    main()
