"""Prefix caching on vs off, same engine settings, same sitting.

    python benchmarks/prefix_cache.py [--json benchmarks/results/prefix_cache.json]

Workloads (token prompts from real English text, greedy, fixed output length):
- shared:    a ~1,000-token system prompt + a distinct 20-40 token user turn per request;
- multiturn: conversations whose every turn re-sends the whole history plus a new turn;
- unshared:  distinct ~300-token prompts (the cost of caching when it cannot help).
Clients run closed-loop at concurrency c: each keeps one request in flight and sends the
next (or its conversation's next turn) when it finishes. TTFT is arrival -> first token.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from sluice import LLMEngine, SamplingParams
from sluice.bench.serve import percentile
from sluice.bench.workload import make_prompts


def drive(engine: LLMEngine, sessions: list[list[list[int]]], concurrency: int, out_len: int) -> dict:
    """Run sessions (lists of turns) with `concurrency` clients; returns TTFTs and throughput."""
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    pending = list(range(len(sessions)))
    state = {}  # request id -> (session, turn, prompt)
    history = {i: [] for i in range(len(sessions))}
    ttfts, tokens, rid = [], 0, 0

    def launch(s: int, turn: int) -> None:
        nonlocal rid
        prompt = history[s] + sessions[s][turn]
        engine.add_request(f"q{rid}", prompt, params)
        state[f"q{rid}"] = (s, turn, prompt)
        rid += 1

    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        launch(pending.pop(0), 0)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if not out.finished:
                continue
            s, turn, prompt = state.pop(out.request_id)
            ttfts.append(out.times.first_token - out.times.arrival)
            tokens += len(out.outputs[0].token_ids)
            history[s] = prompt + out.outputs[0].token_ids
            if turn + 1 < len(sessions[s]):
                launch(s, turn + 1)
            elif pending:
                launch(pending.pop(0), 0)
    secs = time.perf_counter() - t0
    return {"ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "output_tok_per_s": tokens / secs, "seconds": secs, "requests": len(ttfts)}


def workloads(tokenizer, seed: int) -> dict:
    rng = random.Random(seed)
    system = make_prompts(tokenizer, 1, 1000, 1000, seed)[0]
    turns = make_prompts(tokenizer, 400, 20, 40, seed + 1)
    shared = [[system + turns[i]] for i in range(64)]
    multiturn = [[turns[100 + 4 * c + t] for t in range(4)] for c in range(16)]
    for conv in multiturn:  # each conversation opens with its own ~400-token context
        conv[0] = make_prompts(tokenizer, 1, 400, 400, seed + 10 + rng.randrange(10**6))[0] + conv[0]
    unshared = [[p] for p in make_prompts(tokenizer, 32, 280, 320, seed + 2)]
    return {"shared": shared, "multiturn": multiturn, "unshared": unshared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    engines = {on: LLMEngine.from_kwargs(model=args.model, enable_prefix_caching=on) for on in (True, False)}
    loads = workloads(engines[True].tokenizer, args.seed)
    # (workload, concurrency, sessions, repeats): the unshared case looks for a few-percent
    # difference, so it alternates on/off three times and keeps the medians.
    plan = [("shared", 1, 8, 1), ("shared", 16, 64, 1), ("multiturn", 1, 4, 1), ("multiturn", 16, 16, 1),
            ("unshared", 16, 32, 3)]
    results = []
    for name, c, n, repeats in plan:
        row = {"workload": name, "concurrency": c, "repeats": repeats}
        runs = {True: [], False: []}
        for _ in range(repeats):
            for on in (True, False):
                engines[on].reset_prefix_cache()
                drive(engines[on], loads[name][:2], c, 4)  # warm-up; its cache is dropped below
                engines[on].reset_prefix_cache()
                runs[on].append(drive(engines[on], loads[name][:n], c, args.output_len))
        for on in (True, False):
            row["on" if on else "off"] = {k: statistics.median(r[k] for r in runs[on]) for k in runs[on][0]}
        row["ttft_p50_off_over_on"] = row["off"]["ttft_p50_s"] / row["on"]["ttft_p50_s"]
        row["throughput_on_over_off"] = row["on"]["output_tok_per_s"] / row["off"]["output_tok_per_s"]
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
