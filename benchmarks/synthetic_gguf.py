"""A GGUF of a Llama model's shape with random weights in a given quantized type, for
measuring what a load costs at sizes that cannot be downloaded here (docs/benchmarks.md,
"Memory after a load"). The blocks are random bytes with small float16 scales (Q4_1: d and
m; Q8_0: d), written as they are, so a 1B file takes seconds; the vocabulary and chat
template are the default model's (SmolLM2's 49,152 tokens).

    python benchmarks/synthetic_gguf.py /tmp/llama-1b-q4_1.gguf --hidden 2048 --layers 22 \\
        --ffn 5632 --heads 32 --kv-heads 4
    python benchmarks/load_memory.py --model /tmp/llama-1b-q4_1.gguf --modes auto
"""
from __future__ import annotations

import argparse

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

from sluice.models.loader import resolve_model

# Bytes per block of 32 weights: float16 scale(s), then the values.
BLOCK = {"Q4_1": (2, 16), "Q8_0": (1, 32)}


def random_blocks(rows: int, k: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    scales, values = BLOCK[kind]
    nblk = k // 32
    out = np.empty((rows, nblk, 2 * scales + values), dtype=np.uint8)
    d = rng.uniform(1e-3, 4e-3, size=(rows, nblk, scales)).astype(np.float16)
    if kind == "Q4_1":
        d[..., 1] = -d[..., 0] * 7.5  # m: the block's minimum, so the values centre on zero
    out[..., :2 * scales] = d.view(np.uint8)
    out[..., 2 * scales:] = rng.integers(0, 256, size=(rows, nblk, values), dtype=np.uint8)
    return out.reshape(rows, -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--type", default="Q4_1", choices=["Q4_1", "Q8_0"], help="the decoder linear weights' type")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    h, d = args.hidden, args.hidden // args.heads
    w = GGUFWriter(args.path, "llama")
    w.add_context_length(2048)
    w.add_block_count(args.layers)
    w.add_embedding_length(h)
    w.add_feed_forward_length(args.ffn)
    w.add_head_count(args.heads)
    w.add_head_count_kv(args.kv_heads)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(LlamaFileType.MOSTLY_Q4_1 if args.type == "Q4_1" else LlamaFileType.MOSTLY_Q8_0)
    vocab = 0
    for field in GGUFReader(str(resolve_model("smollm2-135m").path)).fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(field.name, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype.name == "ARRAY" else None)
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(field.contents())
    kind = GGMLQuantizationType[args.type]

    def matrix(name: str, rows: int, k: int, t: str) -> None:
        w.add_tensor(name, random_blocks(rows, k, t, rng), raw_dtype=GGMLQuantizationType[t])

    matrix("token_embd.weight", vocab, h, "Q8_0")  # tied head, as SmolLM2's
    w.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    for i in range(args.layers):
        for name, rows, k in (("attn_q", h, h), ("attn_k", args.kv_heads * d, h), ("attn_v", args.kv_heads * d, h),
                              ("attn_output", h, h), ("ffn_gate", args.ffn, h), ("ffn_up", args.ffn, h),
                              ("ffn_down", h, args.ffn)):
            matrix(f"blk.{i}.{name}.weight", rows, k, kind.name)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(h, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(h, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
