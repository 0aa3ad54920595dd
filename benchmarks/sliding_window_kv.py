"""Long contexts on a model with sliding-window layers (Gemma 3): how much KV cache a
sequence holds, and how many sequences a fixed cache runs at once.

One engine (speculation off), --requests requests of --prompt random tokens and --output
generated tokens each, all queued at once into a cache of --kv-gib GiB; every step
records the blocks in use (per layer kind where the engine has kinds) and the running
count. Prints one JSON line: the peak running requests, preemptions, the KV bytes one
running request holds once past its prompt (median over decode steps), the peaks per
kind and the wall time.

    python benchmarks/sliding_window_kv.py [--model gemma3-270m] [--kv-gib 0.25]
        [--requests 12] [--prompt 2048] [--output 32]

For the plain cache (every layer keeping every block) run it with PYTHONPATH set to a
revision before sliding-window groups (docs/benchmarks.md, "Sliding-window KV").
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time


def main() -> int:
    from sluice import LLMEngine, SamplingParams
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--kv-gib", type=float, default=0.25)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--output", type=int, default=32)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    engine = LLMEngine.from_kwargs(model=args.model, speculative_method=None, kv_cache_memory=args.kv_gib,
                                   max_num_batched_tokens=args.max_num_batched_tokens,
                                   max_model_len=args.prompt + args.output)
    kv, sched, runner = engine.kv, engine.scheduler, engine.runner
    per_block = engine.backend.kv_bytes_per_block(runner.arch, kv.block_size, runner.num_kv_heads)
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True)
    for i in range(args.requests):
        engine.add_request(f"r{i}", [rng.randrange(3, 40000) for _ in range(args.prompt)], params)
    by_kind = getattr(runner, "layout", None)
    peaks: dict[str, int] = {}
    per_seq: list[float] = []
    most_running = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = sched.running
        most_running = max(most_running, len(running))
        used = kv.num_blocks - kv.num_free_blocks
        peaks["all"] = max(peaks.get("all", 0), used)
        if by_kind is not None:
            groups = kv.blocks_by_group()
            for kind, gs in by_kind.kinds().items():
                peaks[kind] = max(peaks.get(kind, 0), sum(groups[g] for g in gs))
        # Every running request past its prompt: the blocks each holds (none shared here).
        if running and all(r.num_output_tokens > 0 for r in running):
            per_seq.append(used * per_block / len(running))
    wall = time.perf_counter() - t0
    print(json.dumps({
        "kv_line": f"{kv.num_blocks} blocks of {kv.block_size} tokens, {per_block} bytes each",
        "layout": by_kind.describe() if by_kind is not None else "plain",
        "requests": args.requests, "prompt": args.prompt, "output": args.output,
        "most_running": most_running, "preemptions": sched.num_preemptions,
        "kv_mb_per_running_request": round(statistics.median(per_seq) / 2**20, 1) if per_seq else None,
        "peak_blocks": peaks, "wall_s": round(wall, 1),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
