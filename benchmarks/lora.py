"""The cost of serving LoRA adapters: decode step time at c requests, the base model alone
(an engine without LoRA) against the same engine with adapters on, its requests spread
round-robin over N adapters (Punica's mixed batch), in one sitting, alternating, medians.

Adapters are random, rank --rank on all seven projections (q/k/v/o/gate/up/down), written
in PEFT's format for the model's shapes; their values do not change the work. --shape runs
a bigger model's shape with random weights in bfloat16 (load_format="dummy") instead of
--model: what an adapter costs depends on its size beside the model's (rank 16 on every
projection is 6% of SmolLM2-135M's weights, 1% of a 1B model's).

    python benchmarks/lora.py [--model smollm2-135m | --shape llama-1b] [--adapters 8] [--rank 16]
                              [--concurrency 1,8,32] [--rounds 3]

Prints one JSON line: per c, the median of each mode's mean decode step (ms) and the ratio.
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

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Model shapes for --shape (Llama-family configs; SmolLM2's tokenizer and vocabulary).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8),
}


def shape_folder(root: Path, shape: str) -> str:
    """A config-only model folder of that shape (weights made at load: load_format="dummy")."""
    from transformers import AutoTokenizer, LlamaConfig

    from sluice.models.loader import resolve_model
    src = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
    cfg = LlamaConfig(vocab_size=49152, max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      **SHAPES[shape])
    cfg.architectures = ["LlamaForCausalLM"]
    d = root / shape
    d.mkdir()
    cfg.save_pretrained(d)
    tok.save_pretrained(d)
    return str(d)


def write_adapter(folder: Path, slots: dict, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for a model whose checkpoint map is `slots`."""
    import torch
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, slot in slots.items():
        module = name.removesuffix(".weight")
        if module.rpartition(".")[2] not in TARGETS or ".experts." in module:
            continue
        out_features, in_features = slot.shape
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features**0.5
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none"}))


def main() -> int:
    from sluice import LLMEngine
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.TemporaryDirectory()
    root = Path(tmp.name)
    model = shape_folder(root, args.shape) if args.shape else args.model
    common = dict(model=model, speculative_method=None, max_num_seqs=max(args.concurrency))
    if args.shape:
        common.update(load_format="dummy", dtype="bfloat16")
    base = LLMEngine.from_kwargs(**common)
    slots = base.runner.model.weight_slots()
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_adapter(root / "adapters" / name, slots, args.rank, i)
    lora = LLMEngine.from_kwargs(**common, lora_modules={n: str(root / "adapters" / n) for n in names},
                                 max_loras=args.adapters)
    prompt = 16 if args.shape else 64  # a bigger model's prompts are slow to compute on 2 cores
    modes = {"base": (base, [None]), "lora-on, base rows": (lora, [None]), f"{args.adapters} adapters": (lora, names)}
    rng = random.Random(0)
    for engine, loras in modes.values():
        decode_step_ms(engine, rng, 4, 8, prompt, loras)  # warm
    times: dict[str, dict[int, list[float]]] = {m: {c: [] for c in args.concurrency} for m in modes}
    for _ in range(args.rounds):
        for c in args.concurrency:
            n_out = (64 if c <= 8 else 32) // (4 if args.shape else 1)
            for mode, (engine, loras) in modes.items():
                times[mode][c].append(decode_step_ms(engine, rng, c, n_out, prompt, loras))
    out = {"model": args.shape or args.model, "plan": base.backend.line(), "rank": args.rank,
           "adapters": args.adapters}
    for c in args.concurrency:
        med = {m: statistics.median(times[m][c]) for m in modes}
        out[f"c{c}"] = {m: round(v, 2) for m, v in med.items()}
        out[f"c{c}"]["adapters/base"] = round(med[f"{args.adapters} adapters"] / med["base"], 3)
    print(json.dumps(out))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
