"""Offline throughput: continuous batching vs static batching vs one request at a time,
all in the same engine and sitting.

    python benchmarks/throughput.py                    # 64 requests, 128 output tokens
    python benchmarks/throughput.py --mixed-output     # outputs of 16..512 tokens

(a) continuous: every request is queued at once; the scheduler admits up to --batch running
    requests and refills a slot the step one finishes.
(b) static: batches of --batch requests; the next batch is admitted only when the whole
    previous batch has finished. A finished request leaves the batch, so later steps of
    the batch run fewer rows (kinder to static batching than `generate` is).
(b') static, padded: as (b), but every request of a batch runs until the batch's longest
    output is done and only its own tokens count: what Hugging Face `generate` does with a
    padded batch, whose finished rows keep computing (prompts are still not padded here).
(b'') static as `generate` runs it: as (b'), and every prompt of a batch is also left-padded
    to the batch's longest with a filler token. `generate` masks its pad tokens out of
    attention; here the request attends them, which costs the same arithmetic (the
    outputs differ, the work does not).
(c) sequential: one request at a time, on the first --sequential-requests requests
    (a full sequential run would take many minutes; its rate does not depend on the count).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from sluice import LLMEngine, SamplingParams
from sluice.bench.workload import make_prompts


def run_waves(engine: LLMEngine, waves: list[list[tuple[list[int], int]]], pad: bool = False,
              pad_prompts: bool = False) -> tuple[int, float]:
    """Run each wave to completion before queuing the next; returns (output tokens, seconds).
    pad: every request of a wave generates as many tokens as the wave's longest, of which
    only its own count. pad_prompts: every prompt is left-padded to the wave's longest."""
    tokens, t0, rid = 0, time.perf_counter(), 0
    filler = min(engine.tokenizer.eos_token_ids, default=0)
    for wave in waves:
        wanted = {}
        longest = max(out_len for _, out_len in wave)
        longest_prompt = max(len(prompt) for prompt, _ in wave)
        for prompt, out_len in wave:
            if pad_prompts:
                prompt = [filler] * (longest_prompt - len(prompt)) + prompt
            wanted[f"r{rid}"] = out_len
            params = SamplingParams(temperature=0, max_tokens=longest if pad else out_len, ignore_eos=True)
            engine.add_request(f"r{rid}", prompt, params)
            rid += 1
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens += min(len(o.outputs[0].token_ids), wanted[o.request_id])
    return tokens, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=["int8", "w8a8"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32, help="running requests at most, for (a) and (b)")
    ap.add_argument("--min-input", type=int, default=100)
    ap.add_argument("--max-input", type=int, default=400)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--mixed-output", action="store_true", help="output lengths uniform in 16..512")
    ap.add_argument("--sequential-requests", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    # Prefix caching off: every mode runs the same prompts, and later modes must not find
    # the earlier ones' prompts cached. This benchmark compares scheduling, not caching.
    engine = LLMEngine.from_kwargs(model=args.model, dtype=args.dtype, quantization=args.quantization,
                                   max_num_seqs=args.batch, enable_prefix_caching=False)
    prompts = make_prompts(engine.tokenizer, args.requests, args.min_input, args.max_input, args.seed)
    rng = random.Random(args.seed + 1)
    out_lens = [rng.randint(16, 512) if args.mixed_output else args.output_len for _ in prompts]
    work = list(zip(prompts, out_lens))

    # Warm-up: first calls pay for allocator growth and one-time kernel selection.
    run_waves(engine, [work[:4]])

    b = args.batch
    modes = {
        "continuous": lambda: run_waves(engine, [work]),
        "static": lambda: run_waves(engine, [work[i:i + b] for i in range(0, len(work), b)]),
        "static_padded": lambda: run_waves(engine, [work[i:i + b] for i in range(0, len(work), b)], pad=True),
        "static_generate": lambda: run_waves(engine, [work[i:i + b] for i in range(0, len(work), b)], pad=True,
                                             pad_prompts=True),
        "sequential": lambda: run_waves(engine, [[w] for w in work[:args.sequential_requests]]),
    }
    results: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats):
        for mode, fn in modes.items():
            tokens, secs = fn()
            results[mode].append(tokens / secs)
            print(f"repeat {rep} {mode:>15}: {tokens} tokens in {secs:.1f}s = {tokens / secs:.1f} tok/s", flush=True)
    med = {m: statistics.median(v) for m, v in results.items()}
    summary = {
        "model": args.model, "dtype": str(engine.dtype), "quantization": args.quantization,
        "requests": args.requests, "batch": b,
        "input_len": [args.min_input, args.max_input],
        "output_len": "16..512" if args.mixed_output else args.output_len,
        "output_tok_per_s": med,
        "continuous_over_static": med["continuous"] / med["static"],
        "continuous_over_static_padded": med["continuous"] / med["static_padded"],
        "continuous_over_static_generate": med["continuous"] / med["static_generate"],
        "continuous_over_sequential": med["continuous"] / med["sequential"],
        "preemptions": engine.scheduler.num_preemptions,
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
