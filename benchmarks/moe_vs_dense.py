"""A mixture-of-experts model against the dense model of the same active size: decode step
time by concurrency, random weights (load_format="dummy"), both in one sitting, alternating.

Shapes (Qwen3-MoE's, scaled to a 2-core CPU): hidden 1024, 16 query / 4 KV heads of 64, 8
layers; the MoE has 16 experts of intermediate 384, 2 per token (768 active); the dense
twin an MLP of 768: the same weights read per token when every expert is hit... which, at
c >= 8 with 16 experts, is most of them: the MoE step reads more weights than its twin.

    python benchmarks/moe_vs_dense.py [--concurrency 1,8,32] [--rounds 3] [--quantization none]

Prints one JSON line: per model and c, the median over rounds of the mean decode step (ms).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from decode_steps import decode_step_ms  # (benchmarks/ is the script's own folder)

COMMON = dict(vocab_size=49152, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=True)


def folders(root: Path) -> dict[str, str]:
    from transformers import AutoTokenizer, Qwen3Config, Qwen3MoeConfig

    from sluice.models.loader import resolve_model
    src = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
    out = {}
    for name, cfg in (("moe-16x384-top2", Qwen3MoeConfig(**COMMON, intermediate_size=768, num_experts=16,
                                                         num_experts_per_tok=2, moe_intermediate_size=384)),
                      ("dense-768", Qwen3Config(**COMMON, intermediate_size=768))):
        d = root / name
        d.mkdir()
        cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
        cfg.save_pretrained(d)
        tok.save_pretrained(d)
        out[name] = str(d)
    return out


def main() -> int:
    from sluice import LLMEngine
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="none")
    args = ap.parse_args()
    q = None if args.quantization == "none" else args.quantization
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        engines = {name: LLMEngine.from_kwargs(model=path, load_format="dummy", speculative_method=None,
                                               quantization=q, max_num_seqs=max(args.concurrency),
                                               kv_cache_memory=1.0)
                   for name, path in folders(Path(tmp)).items()}

        for e in engines.values():
            decode_step_ms(e, rng, 2, 8)  # warm
        times: dict[str, dict[int, list[float]]] = {n: {c: [] for c in args.concurrency} for n in engines}
        for _ in range(args.rounds):
            for c in args.concurrency:
                for name, e in engines.items():
                    times[name][c].append(decode_step_ms(e, rng, c, 32 if c <= 8 else 24))
        out = {"plan": next(iter(engines.values())).backend.line()}
        for name in engines:
            out[name] = {f"c{c}": round(statistics.median(v), 2) for c, v in times[name].items()}
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
