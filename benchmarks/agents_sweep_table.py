"""The served agent sweep's table (benchmarks/agents_served_sweep.sh): per cell (shape,
cache, load), FCFS's job times and each other configuration's speed-up on them (FCFS's
time / its time: above 1 is better) and its throughput ratio, medians over rounds.

    python benchmarks/agents_sweep_table.py benchmarks/results/agents_served_sweep
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

CONFIGS = ["fcfs", "fcfs_tier", "program", "program_tier"]
CELL = re.compile(r"(?P<shape>\w+?)_kv(?P<kv>[\d.]+)_rate(?P<rate>[\d.]+)$")


def med(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/agents_served_sweep")
    cells = []
    for d in root.iterdir():
        m = CELL.match(d.name)
        if d.is_dir() and m:
            cells.append((m["shape"], float(m["kv"]), float(m["rate"]), d))
    cells.sort(key=lambda c: (c[0] != "short", c[1], c[2]))
    present = [c for c in CONFIGS[1:] if any(any(d.glob(f"programs_{c}_r*.json")) for *_, d in cells)]
    print("| shape | KV GiB | programs/s | rounds | FCFS JCT p50 / p99 s | FCFS hits | failed calls | "
          + " | ".join(f"{c} p50 / p99 / tok/s vs FCFS" for c in present) + " |")
    print("|---|---|---|---|---|---|---|" + "---|" * len(present))
    for shape, kv, rate, d in cells:
        runs = {c: [json.loads(p.read_text()) for p in sorted(d.glob(f"programs_{c}_r*.json"))] for c in CONFIGS}
        base = runs["fcfs"]
        if not base:
            continue
        f50, f99, ftok = med(base, "jct_p50_s"), med(base, "jct_p99_s"), med(base, "output_tok_per_s")
        failed = sum(r["failed_calls"] for rs in runs.values() for r in rs)
        cols = []
        for c in present:
            if not runs[c]:
                cols.append("-")
                continue
            p50, p99, tok = med(runs[c], "jct_p50_s"), med(runs[c], "jct_p99_s"), med(runs[c], "output_tok_per_s")
            cols.append(f"{f50 / p50:.2f}x / {f99 / p99:.2f}x / {tok / ftok:.2f}x")
        print(f"| {shape} | {kv:g} | {rate:g} | {len(base)} | {f50:.1f} / {f99:.1f} | "
              f"{med(base, 'prefix_hit_rate'):.0%} | {failed} | " + " | ".join(cols) + " |")


if __name__ == "__main__":
    main()
