"""GGUF files of a Llama model's shape with random weights in a given quantized type: for
measuring what a load costs at sizes that cannot be downloaded (benchmarks/synthetic_gguf.py,
benchmarks/load_memory.py), and for tests of layouts no shipped model has (an untied head).
The blocks are random bytes with small float16 scales (Q4_1: d and m; Q8_0: d), written as
they are, so a 1B file takes seconds; the vocabulary and chat template are the default
model's (SmolLM2's 49,152 tokens)."""
from __future__ import annotations

import numpy as np

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


def write_synthetic_gguf(path, hidden: int = 2048, layers: int = 22, ffn: int = 5632, heads: int = 32,
                         kv_heads: int = 4, kind: str = "Q4_1", untied: bool = False, seed: int = 0) -> None:
    """A Llama GGUF at `path`: decoder linear weights in `kind` blocks, the embedding (and,
    untied, an output matrix of its own) in Q8_0, norms of ones."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType

    from sluice.models.loader import resolve_model
    rng = np.random.default_rng(seed)
    d = hidden // heads
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(LlamaFileType.MOSTLY_Q4_1 if kind == "Q4_1" else LlamaFileType.MOSTLY_Q8_0)
    vocab = 0
    for field in GGUFReader(str(resolve_model("smollm2-135m").path)).fields.values():
        if field.name.startswith("tokenizer."):
            vtype = field.types[0]
            w.add_key_value(field.name, field.contents(), vtype,
                            sub_type=field.types[-1] if vtype.name == "ARRAY" else None)
            if field.name == "tokenizer.ggml.tokens":
                vocab = len(field.contents())

    def matrix(name: str, rows: int, k: int, t: str) -> None:
        w.add_tensor(name, random_blocks(rows, k, t, rng), raw_dtype=GGMLQuantizationType[t])

    matrix("token_embd.weight", vocab, hidden, "Q8_0")  # a tied head, as SmolLM2's, unless untied
    if untied:
        matrix("output.weight", vocab, hidden, "Q8_0")
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        for name, rows, k in (("attn_q", hidden, hidden), ("attn_k", kv_heads * d, hidden),
                              ("attn_v", kv_heads * d, hidden), ("attn_output", hidden, hidden),
                              ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            matrix(f"blk.{i}.{name}.weight", rows, k, kind)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
