"""Asynchronous scheduling on and off, offline, in one sitting: the same closed batches
(c32: 32 requests of 128 random prompt tokens and 64 outputs; c1: one request of 64),
alternating off / on for --rounds rounds, each run a fresh engine, medians. Speculation is
off (its gate follows the clock; this compares the loops alone).

    python benchmarks/async_scheduling.py [--rounds 3] [--device cpu] [--model M] [--json F]

On a CPU a launch has computed its step when it returns, so the overlap loop has nothing to
hide; this measures what its bookkeeping costs there. On a GPU benchmarks/gpu_check.py
measures it on the 8B shape.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

RUN = r"""
import json, random, sys, time
from sluice import LLMEngine, SamplingParams
kw = json.loads(sys.argv[1])
engine = LLMEngine.from_kwargs(speculative_method=None, **kw)
rng = random.Random(0)

def run(c, n_out):
    params = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)
    for i in range(c):
        engine.add_request(f"r{c}-{i}-{time.time()}", [rng.randrange(3, 40000) for _ in range(128)], params)
    t0, toks = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                toks += len(o.outputs[0].token_ids)
    return toks / (time.perf_counter() - t0)

run(4, 8)  # warm: kernels loaded, first shapes seen
print(json.dumps({"c32": run(32, 64), "c1": run(1, 64)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    kw = {"device": args.device}
    if args.model:
        kw["model"] = args.model
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for mode in ("off", "on"):
            out = subprocess.run([sys.executable, "-c", RUN, json.dumps({**kw, "async_scheduling": mode == "on"})],
                                 capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r + 1} {mode}: {runs[mode][-1]}", flush=True)
    summary = {mode: {k: statistics.median(x[k] for x in rs) for k in ("c32", "c1")} for mode, rs in runs.items()}
    print("| async scheduling | c32 output tok/s | c1 output tok/s |\n|---|---|---|")
    for mode in ("off", "on"):
        print(f"| {mode} | {summary[mode]['c32']:.1f} | {summary[mode]['c1']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": runs, "median": summary, "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    return 0


if __name__ == "__main__":
    random.seed(0)
    sys.exit(main())
