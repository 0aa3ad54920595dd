"""Does a speed trick change outputs? Greedy agreement with float32 and perplexity on
held-out text, for float32, bfloat16 and int8 weights of the same model.

    python benchmarks/quality.py [--json benchmarks/results/quality.json]

Agreement: 32 greedy tokens on the test prompts (plain and chat), compared with float32:
identical sequences, and mean length of the common prefix. Perplexity: 8 windows of 512
tokens of held-out English text (the standard library's documentation), every position
scored in one prefill through the engine's own model and paged KV cache.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from sluice import LLM, SamplingParams
from sluice.bench.workload import make_prompts
from sluice.core.scheduler import ScheduledRequest, StepPlan
from sluice.request import Request

PROMPTS = [
    "Hello",
    "The history of the Roman Empire begins with",
    "In a small village by the sea, there lived an old fisherman who every morning walked to the "
    "harbour, checked his nets and talked to the gulls about the weather and the price of fish.",
    "def fibonacci(n):",
]
CHATS = ["What is the capital of France?", "Give me three tips for learning a language.",
         "Explain photosynthesis in one sentence.", "Write a haiku about autumn."]


@torch.inference_mode()
def perplexity(llm: LLM, windows: list[list[int]]) -> float:
    engine = llm.engine
    nll, count = 0.0, 0
    for i, ids in enumerate(windows):
        req = Request(f"ppl{i}", ids, SamplingParams(max_tokens=1), set(), 1)
        engine.kv.allocate(req, len(ids))
        entry = ScheduledRequest(req.request_id, ids, 0, engine.kv.block_ids(req.request_id), True,
                                 req.params, ids, [])
        input_ids, positions, meta, _ = engine.runner._prepare(StepPlan([entry], len(ids)))
        hidden = engine.runner.model(input_ids, positions, meta, engine.runner.kv_caches)
        logp = torch.log_softmax(engine.runner.model.compute_logits(hidden[:-1]).float(), dim=-1)
        nll -= float(logp.gather(1, input_ids[1:, None]).sum())
        count += len(ids) - 1
        engine.kv.free(req)
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = {"float32": dict(dtype="float32"), "bfloat16": dict(dtype="bfloat16"),
                "int8": dict(dtype="bfloat16", quantization="int8")}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    tokens, rows = {}, {}
    for name, kwargs in variants.items():
        llm = LLM(model=args.model, kv_cache_memory=0.3, enable_prefix_caching=False, **kwargs)
        prompts = PROMPTS + [llm.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
        tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        windows = make_prompts(llm.tokenizer, 8, 512, 512, seed=123)
        rows[name] = {"perplexity": perplexity(llm, windows)}
        del llm
    for name, row in rows.items():
        same = [a == b for a, b in zip(tokens[name], tokens["float32"])]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                  for a, b in zip(tokens[name], tokens["float32"])]
        row["identical_to_float32"] = f"{sum(same)}/{len(same)}"
        row["mean_common_prefix_tokens"] = sum(prefix) / len(prefix)
        print(json.dumps({"variant": name, **row}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
