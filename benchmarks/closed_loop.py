"""The served c32 workload offline: 64 requests of ~210-token prompts and 128 output tokens
(greedy, or sampled at --temperature: what a client that sends none, like guidellm, gets at
OpenAI's default of 1; ignore_eos), at most 32 running, a waiting request admitted the step after one
finishes; engine settings compared side by side, alternating, in one process. Per
variant and round: output tok/s, and the count and median time of decode-only steps and
of steps that also carry prompt tokens.

    python benchmarks/closed_loop.py --rounds 3 \\
        w8a8='{"quantization": "w8a8"}' w8a8_kv8='{"quantization": "w8a8", "kv_cache_dtype": "int8"}'

Each variant is NAME=JSON of engine options (LLMEngine.from_kwargs).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from sluice import LLMEngine, SamplingParams
from sluice.bench.workload import make_prompts


def run(engine: LLMEngine, seed: int, requests: int, output_len: int, temperature: float = 0.0) -> dict:
    for i, prompt in enumerate(make_prompts(engine.tokenizer, requests, 200, 220, seed=seed)):
        engine.add_request(f"r{seed}_{i}", prompt,
                           SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True))
    decode, mixed = [], []
    execute = engine.runner.execute

    def timed(plan):
        t = time.perf_counter()
        result = execute(plan)
        (mixed if any(len(e.token_ids) > 1 for e in plan.scheduled) else decode).append(time.perf_counter() - t)
        return result
    engine.runner.execute = timed
    t0 = time.perf_counter()
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.runner.execute = execute
    elapsed = time.perf_counter() - t0
    return {"tok_per_s": requests * output_len / elapsed,
            "decode_steps": len(decode), "decode_ms": 1e3 * statistics.median(decode),
            "mixed_steps": len(mixed), "mixed_ms": 1e3 * statistics.median(mixed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="NAME=JSON engine options")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    args = ap.parse_args()
    variants = {}
    for v in args.variants:
        name, _, options = v.partition("=")
        variants[name] = json.loads(options or "{}")
    engines = {name: LLMEngine.from_kwargs(max_num_seqs=args.concurrency, **options)
               for name, options in variants.items()}
    for r in range(args.rounds):
        for name, engine in engines.items():
            gc.collect()
            m = run(engine, 100 + r, args.requests, args.output_len, args.temperature)
            print(f"{name:12s} round {r}: {m['tok_per_s']:6.1f} tok/s  decode {m['decode_steps']} x "
                  f"{m['decode_ms']:.1f} ms  mixed {m['mixed_steps']} x {m['mixed_ms']:.1f} ms", flush=True)


if __name__ == "__main__":
    main()
