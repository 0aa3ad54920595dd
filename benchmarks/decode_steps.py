"""Offline decode step time by concurrency: one engine (the default mode unless flags say
otherwise, speculation off), for each c in --concurrency c requests of 64 random prompt
tokens, the mean wall time of their decode steps after the first three steps, in ms.

    python benchmarks/decode_steps.py [--model gemma3-270m] [--cpu-isa avx512] [--quantization auto]
                                      [--concurrency 1,2,4,8,16,32] [--temperature 1 [--top-p 0.95]]

--temperature above 0 samples (what clients that send none get: OpenAI's default is 1)
instead of the greedy path; --top-p adds nucleus sampling.

Prints one JSON line. For an A/B of two revisions run it alternately with PYTHONPATH set to
each one's src/ (docs/benchmarks.md, "w4a8 nibbles").
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path



def decode_step_ms(engine, rng: random.Random, c: int, n_out: int, prompt: int = 64,
                   loras: list[str | None] | None = None, temperature: float = 0.0, top_p: float = 1.0) -> float:
    """c requests of `prompt` random tokens (request i with LoRA adapter loras[i % len], if
    given): the mean wall time of their decode steps after the first three, in ms."""
    from sluice import SamplingParams
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=n_out, ignore_eos=True)
    for i in range(c):
        engine.add_request(f"r{c}-{i}-{time.time()}", [rng.randrange(3, 40000) for _ in range(prompt)], params,
                           lora=loras[i % len(loras)] if loras else None)
    for _ in range(3):
        engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> int:
    from sluice import LLMEngine
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--cpu-isa", default="auto")
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    args = ap.parse_args()
    engine = LLMEngine.from_kwargs(model=args.model, speculative_method=None, cpu_isa=args.cpu_isa,
                                   quantization=None if args.quantization == "none" else args.quantization,
                                   max_num_seqs=max(args.concurrency))
    rng = random.Random(0)
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    decode_step_ms(engine, rng, 2, 8, **sampling)  # warm
    out = {"plan": engine.backend.line()}
    for c in args.concurrency:
        out[f"c{c}"] = round(decode_step_ms(engine, rng, c, 64 if c <= 8 else 48 if c <= 16 else 32,
                                                  **sampling), 2)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
