"""The agent-load sweep (issue 44): every order with and without the host KV tier, over
loads from well below to well above capacity, two cache sizes and two workload shapes,
through the real scheduler in simulated time (agents_sim.py), medians over seeds.

    .venv/bin/python benchmarks/agents_sim.py fit --out /tmp/step_model.json   # once per machine
    .venv/bin/python benchmarks/agents_sweep.py --model-json /tmp/step_model.json > sweep.md

Shapes: `short` = 96 programs, 90% of 2-3 calls, 60-120-token tool results; `long` = 24
programs of 8-12 calls with 300-600-token tool results (big histories). Configurations:
fcfs (no sessions: prefix caching and LRU, what other engines do), fcfs + the tier,
program + sessions (PLAS, pins, warm calls first, the door), and program + sessions + the
tier. The table gives FCFS's job times and each other configuration's speed-up on them
(FCFS's time / its time: above 1 is better), and the throughput ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SHAPES = {"short": ["--programs", "96", "--short-frac", "0.9", "--tool-len", "60", "120"],
          "long": ["--programs", "24", "--short-frac", "0", "--tool-len", "300", "600"]}
CONFIGS = {"fcfs": ["--policy", "fcfs"],
           "fcfs+tier": ["--policy", "fcfs", "--offload-gib", "OFFLOAD"],
           "program": ["--policy", "program", "--sessions"],
           "program+tier": ["--policy", "program", "--sessions", "--offload-gib", "OFFLOAD"]}


def one(model_json: str, shape: str, kv: float, rate: float, cfg: str, seed: int, offload: float) -> dict:
    flags = [str(offload) if f == "OFFLOAD" else f for f in CONFIGS[cfg]]
    cmd = [sys.executable, "benchmarks/agents_sim.py", "run", "--model-json", model_json, "--kv-gib", str(kv),
           "--program-rate", str(rate), "--seed", str(seed), *SHAPES[shape], *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:  # (a stuck scheduler is a finding: its row says so, the sweep goes on)
        return {"error": done.stderr.strip().splitlines()[-1], "cmd": " ".join(cmd)}
    return json.loads(done.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-json", required=True)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    ap.add_argument("--long-rates", type=float, nargs="+", default=[0.01, 0.02, 0.05, 0.1],
                    help="program rates of the long shape (its programs are ~4x the work)")
    ap.add_argument("--kv-gib", type=float, nargs="+", default=[0.1, 0.25])
    ap.add_argument("--long-kv-gib", type=float, nargs="+", default=[0.25, 0.5],
                    help="cache sizes of the long shape (a history of up to ~8k tokens must fit)")
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2, help="simulations at once (simulated time: any number is exact)")
    ap.add_argument("--json", default=None, help="also write every run's report here")
    args = ap.parse_args(argv)
    grid = [(shape, kv, rate, cfg, seed)
            for shape in SHAPES for kv in (args.kv_gib if shape == "short" else args.long_kv_gib)
            for rate in (args.rates if shape == "short" else args.long_rates)
            for cfg in CONFIGS for seed in range(args.seeds)]
    with ThreadPoolExecutor(args.jobs) as pool:
        reports = list(pool.map(lambda g: one(args.model_json, *g, args.offload_gib), grid))
    runs = {g: r for g, r in zip(grid, reports)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"shape": g[0], "kv_gib": g[1], "rate": g[2], "config": g[3], "seed": g[4], **r}
                       for g, r in runs.items()], f)

    failed = [r for r in reports if "error" in r]
    for r in failed:
        print(f"FAILED: {r['cmd']}: {r['error']}", file=sys.stderr)

    def med(shape, kv, rate, cfg, key):
        values = [runs[(shape, kv, rate, cfg, s)].get(key) for s in range(args.seeds)]
        if any(v is None for v in values):
            return float("nan")  # a run failed (stderr names it)
        return statistics.median(values)

    print(f"| shape | KV GiB | programs/s | FCFS JCT p50 / p99 s | FCFS hits | "
          + " | ".join(f"{c} p50 / p99 / tok/s vs FCFS" for c in list(CONFIGS)[1:]) + " |")
    print("|---|---|---|---|---|" + "---|" * (len(CONFIGS) - 1))
    for shape, kv in [(s, kv) for s in SHAPES for kv in (args.kv_gib if s == "short" else args.long_kv_gib)]:
        for rate in (args.rates if shape == "short" else args.long_rates):
            f50, f99 = med(shape, kv, rate, "fcfs", "jct_p50_s"), med(shape, kv, rate, "fcfs", "jct_p99_s")
            ftok = med(shape, kv, rate, "fcfs", "output_tok_per_s")
            cells = []
            for cfg in list(CONFIGS)[1:]:
                p50, p99 = med(shape, kv, rate, cfg, "jct_p50_s"), med(shape, kv, rate, cfg, "jct_p99_s")
                tok = med(shape, kv, rate, cfg, "output_tok_per_s")
                cells.append(f"{f50 / p50:.2f}x / {f99 / p99:.2f}x / {tok / ftok:.2f}x")
            hits = med(shape, kv, rate, "fcfs", "prefix_hit_rate")
            print(f"| {shape} | {kv} | {rate} | {f50:.1f} / {f99:.1f} | {hits:.0%} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
