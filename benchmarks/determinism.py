"""Cost of deterministic mode: default vs deterministic engine, offline, same sitting.

    python benchmarks/determinism.py            # c1 and c32, SmolLM2 bf16
    python benchmarks/determinism.py --repeats 3 --json benchmarks/results/determinism.json

Workload as in the serving benchmark: prompts of ~210 tokens of English text, 128 output
tokens (ignore_eos), greedy. c1: requests one at a time, TPOT = (last token - first
token) / 127 per request, median. c32: 64 requests queued at once, at most 32 running;
output tokens per second. Modes alternate within each repeat so both see the same
machine load; prefix caching is off so no run reuses another's prompts.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from sluice import LLMEngine, SamplingParams
from sluice.bench.workload import make_prompts


def run(engine: LLMEngine, prompts: list[list[int]], out_len: int) -> tuple[int, float, list[float]]:
    """Queue all prompts, run to completion; (output tokens, seconds, per-request TPOT s)."""
    first: dict[str, float] = {}
    tpots: list[float] = []
    tokens = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            now = time.perf_counter()
            n = len(o.outputs[0].token_ids)
            if n >= 1 and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                tokens += n
                if n > 1:
                    tpots.append((now - first[o.request_id]) / (n - 1))
    return tokens, time.perf_counter() - t0, tpots


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--c1-requests", type=int, default=3)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engines = {mode: LLMEngine.from_kwargs(model=args.model, deterministic=(mode == "deterministic"),
                                           max_num_seqs=args.batch, enable_prefix_caching=False)
               for mode in ("default", "deterministic")}
    tok = engines["default"].tokenizer
    results: dict[str, dict[str, list[float]]] = {m: {"c1_tpot_ms": [], "c32_tok_s": []} for m in engines}
    for r in range(args.repeats):
        # Fresh prompts per repeat, the same for both modes within it.
        prompts = make_prompts(tok, args.requests + args.c1_requests, 200, 220, seed=1000 + r)
        c1, c32 = prompts[:args.c1_requests], prompts[args.c1_requests:]
        for mode, engine in engines.items():
            tpots = []
            for p in c1:
                tpots += run(engine, [p], args.output_len)[2]
            results[mode]["c1_tpot_ms"].append(1e3 * statistics.median(tpots))
            tokens, secs, _ = run(engine, c32, args.output_len)
            results[mode]["c32_tok_s"].append(tokens / secs)
            print(f"repeat {r} {mode:13s} c1 TPOT {results[mode]['c1_tpot_ms'][-1]:6.1f} ms   "
                  f"c{args.batch} {results[mode]['c32_tok_s'][-1]:6.1f} tok/s", flush=True)
    summary = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in results.items()}
    d, x = summary["default"], summary["deterministic"]
    print(f"median: c1 TPOT default {d['c1_tpot_ms']:.1f} ms, deterministic {x['c1_tpot_ms']:.1f} ms "
          f"({x['c1_tpot_ms'] / d['c1_tpot_ms']:.2f}x); c{args.batch} default {d['c32_tok_s']:.1f} tok/s, "
          f"deterministic {x['c32_tok_s']:.1f} tok/s (cost {d['c32_tok_s'] / x['c32_tok_s']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": results, "median": summary}, f, indent=2)


if __name__ == "__main__":
    main()
