"""Markdown tables of benchmarks/agents.sh's results: medians over rounds.

    python benchmarks/agents_table.py benchmarks/results/agents
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(v, scale=1.0, digits=1):
    return "-" if v is None else f"{v * scale:.{digits}f}"


def load(outdir: Path, prefix: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(outdir.glob(f"{prefix}_r*.json"))]


def main() -> None:
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/agents")
    rows = []
    for cfg, label in (("fcfs", "fcfs, no sessions"), ("fcfs_tier", "fcfs, no sessions, host KV tier"),
                       ("program", "program + sessions"), ("program_tier", "program + sessions, host KV tier")):
        runs = load(outdir, f"programs_{cfg}")
        if not runs:
            continue
        rows.append((label, len(runs),
                     med([r["jct_p50_s"] for r in runs]), med([r["jct_p99_s"] for r in runs]),
                     med([r["classes"]["short"]["jct_p50_s"] for r in runs]),
                     med([r["classes"]["long"]["jct_p50_s"] for r in runs]),
                     med([r["output_tok_per_s"] for r in runs]), med([r["prefix_hit_rate"] for r in runs]),
                     sum(r["failed_calls"] for r in runs)))
    if rows:
        print("| configuration | rounds | JCT p50 s | JCT p99 s | short JCT p50 s | long JCT p50 s "
              "| output tok/s | prefix hit rate | failed calls |")
        print("|---|---|---|---|---|---|---|---|---|")
        for label, n, p50, p99, sp50, lp50, tps, hit, failed in rows:
            print(f"| {label} | {n} | {fmt(p50)} | {fmt(p99)} | {fmt(sp50)} | {fmt(lp50)} | {fmt(tps)} "
                  f"| {fmt(hit, 100, 0)}% | {failed} |")
        print()
    rows = []
    for cfg, label in (("alone", "light tenant alone (fair)"), ("fair", "light + heavy, fair"),
                       ("fcfs", "light + heavy, fcfs")):
        runs = load(outdir, f"fairness_{cfg}")
        if not runs:
            continue
        t = [r["tenants"] for r in runs]
        rows.append((label, len(runs), med([x["light"]["ttft_p50_s"] for x in t]),
                     med([x["light"]["ttft_p99_s"] for x in t]), med([x["light"]["jct_p50_s"] for x in t]),
                     med([x.get("heavy", {}).get("ttft_p99_s") for x in t]),
                     med([r["output_tok_per_s"] for r in runs]), sum(r["failed_calls"] for r in runs)))
    if rows:
        print("| configuration | rounds | light TTFT p50 s | light TTFT p99 s | light JCT p50 s "
              "| heavy TTFT p99 s | output tok/s | failed calls |")
        print("|---|---|---|---|---|---|---|---|")
        for label, n, t50, t99, j50, h99, tps, failed in rows:
            print(f"| {label} | {n} | {fmt(t50, 1, 2)} | {fmt(t99, 1, 2)} | {fmt(j50)} | {fmt(h99, 1, 2)} "
                  f"| {fmt(tps)} | {failed} |")


if __name__ == "__main__":
    main()
