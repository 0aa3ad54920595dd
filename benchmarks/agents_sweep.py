"""The agent-load sweep (issue 44): every order with and without the host KV tier, over
loads from well below to well above capacity, two cache sizes and two workload shapes,
through the real scheduler in simulated time (agents_sim.py), medians over seeds.

    .venv/bin/python benchmarks/agents_sim.py fit --out /tmp/step_model.json   # once per machine
    .venv/bin/python benchmarks/kv_offload_copy.py                               # int8 save_us, load_us
    .venv/bin/python benchmarks/agents_sweep.py --model-json /tmp/step_model.json \
        --offload-save-us SAVE --offload-load-us LOAD > sweep.md

Shapes: `short` = 96 programs, 90% of 2-3 calls, 60-120-token tool results; `long` = 24
programs of 8-12 calls with 300-600-token tool results (big histories). Configurations:
fcfs (no sessions: prefix caching and LRU, what other engines do), fcfs + the tier,
fcfs + sessions (pins in FCFS order) with and without the tier, program + sessions (PLAS,
pins, warm calls first, the door), and program + sessions + the tier (arrival order
instead of PLAS inside the door). The table gives FCFS's job times and each other configuration's speed-up on them
(FCFS's time / its time: above 1 is better), and the throughput ratio. Its headroom column
is FCFS's time over each program's time alone on an idle server (`--isolated`): no
configuration's speed-up at that percentile can exceed it, so a target above it is out of
reach at that cell for any scheduler.
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
           # Sessions (pins) under FCFS order: what a session-carrying client got by default
           # before `auto` made program its policy.
           "fcfs+sessions": ["--policy", "fcfs", "--sessions"],
           "fcfs+sessions+tier": ["--policy", "fcfs", "--sessions", "--offload-gib", "OFFLOAD"],
           "program": ["--policy", "program", "--sessions"],
           "program+tier": ["--policy", "program", "--sessions", "--offload-gib", "OFFLOAD"]}
# Each program alone on an idle server with a cache that holds it (agents_sim.py --isolated):
# the job times no order can beat, so FCFS's time over this one is the most any
# configuration can gain on FCFS at that percentile (its "headroom").
ALONE = ["--policy", "program", "--sessions", "--isolated"]
ALONE_KV_GIB = 4.0


def one(model_json: str, shape: str, kv: float, rate: float, cfg: str, seed: int, offload: float,
        copy_us: list[str]) -> dict:
    base, _, variant = cfg.partition("+tier+")  # program+tier+VARIANT: agents_sim.py --variant VARIANT
    if variant:
        flags = CONFIGS[base + "+tier"] + ["--variant", variant]
    else:
        flags = ALONE if cfg == "alone" else CONFIGS[cfg]
    flags = [str(offload) if f == "OFFLOAD" else f for f in flags]
    if "--offload-gib" in flags:
        flags = flags + copy_us
    cmd = [sys.executable, "benchmarks/agents_sim.py", "run", "--model-json", model_json, "--kv-gib", str(kv),
           "--program-rate", str(rate), "--seed", str(seed), *SHAPES[shape], *flags]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:  # (a stuck scheduler is a finding: its row says so, the sweep goes on)
        return {"error": done.stderr.strip().splitlines()[-1], "cmd": " ".join(cmd)}
    return json.loads(done.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-json", required=True)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    ap.add_argument("--long-rates", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2],
                    help="program rates of the long shape (its programs are ~4x the work)")
    ap.add_argument("--kv-gib", type=float, nargs="+", default=[0.1, 0.25])
    ap.add_argument("--long-kv-gib", type=float, nargs="+", default=[0.25, 0.5],
                    help="cache sizes of the long shape (a history of up to ~8k tokens must fit)")
    ap.add_argument("--offload-gib", type=float, default=1.0)
    ap.add_argument("--offload-save-us", type=float, default=None,
                    help="one block saved to the tier, this machine's (benchmarks/kv_offload_copy.py int8 save_us)")
    ap.add_argument("--offload-load-us", type=float, default=None, help="one block copied back (its load_us)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=2, help="simulations at once (simulated time: any number is exact)")
    ap.add_argument("--json", default=None, help="also write every run's report here")
    ap.add_argument("--variants", nargs="+", default=[],
                    help="also program + sessions + tier with each of these agents_sim.py --variant schedulers")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--configs", nargs="+", default=["fcfs", "fcfs+tier", "program", "program+tier"],
                    choices=list(CONFIGS),
                    help="configurations to run (fcfs, the baseline, always runs)")
    args = ap.parse_args(argv)
    configs = ["fcfs"] + [c for c in args.configs if c != "fcfs"] + [f"program+tier+{v}" for v in args.variants]
    grid = [(shape, kv, rate, cfg, seed)
            for shape in args.shapes for kv in (args.kv_gib if shape == "short" else args.long_kv_gib)
            for rate in (args.rates if shape == "short" else args.long_rates)
            for cfg in configs for seed in range(args.seeds)]
    grid += [(shape, ALONE_KV_GIB, 1.0, "alone", seed) for shape in args.shapes for seed in range(args.seeds)]
    copy_us = [f for flag, v in (("--offload-save-us", args.offload_save_us),
                                 ("--offload-load-us", args.offload_load_us)) if v is not None
               for f in (flag, str(v))]
    with ThreadPoolExecutor(args.jobs) as pool:
        reports = list(pool.map(lambda g: one(args.model_json, *g, args.offload_gib, copy_us), grid))
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

    print(f"| shape | KV GiB | programs/s | FCFS JCT p50 / p99 s | FCFS hits | headroom p50 / p99 | "
          + " | ".join(f"{c} p50 / p99 / tok/s vs FCFS" for c in configs[1:]) + " |")
    print("|---|---|---|---|---|---|" + "---|" * (len(configs) - 1))
    for shape, kv in [(s, kv) for s in args.shapes for kv in (args.kv_gib if s == "short" else args.long_kv_gib)]:
        for rate in (args.rates if shape == "short" else args.long_rates):
            f50, f99 = med(shape, kv, rate, "fcfs", "jct_p50_s"), med(shape, kv, rate, "fcfs", "jct_p99_s")
            ftok = med(shape, kv, rate, "fcfs", "output_tok_per_s")
            cells = []
            for cfg in configs[1:]:
                p50, p99 = med(shape, kv, rate, cfg, "jct_p50_s"), med(shape, kv, rate, cfg, "jct_p99_s")
                tok = med(shape, kv, rate, cfg, "output_tok_per_s")
                cells.append(f"{f50 / p50:.2f}x / {f99 / p99:.2f}x / {tok / ftok:.2f}x")
            hits = med(shape, kv, rate, "fcfs", "prefix_hit_rate")
            a50, a99 = med(shape, ALONE_KV_GIB, 1.0, "alone", "jct_p50_s"), med(shape, ALONE_KV_GIB, 1.0, "alone", "jct_p99_s")
            print(f"| {shape} | {kv} | {rate} | {f50:.1f} / {f99:.1f} | {hits:.0%} | {f50 / a50:.2f}x / {f99 / a99:.2f}x | "
                  + " | ".join(cells) + " |")
    for shape in args.shapes:
        a50, a99 = med(shape, ALONE_KV_GIB, 1.0, "alone", "jct_p50_s"), med(shape, ALONE_KV_GIB, 1.0, "alone", "jct_p99_s")
        print(f"\n{shape}: each program alone, JCT p50 / p99 {a50:.1f} / {a99:.1f} s (the headroom's denominator)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
