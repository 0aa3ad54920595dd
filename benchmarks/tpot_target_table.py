"""Table and plot of benchmarks/tpot_target.sh's results: per target, medians over rounds
of c32 output tok/s, TPOT p50 (each request's mean time per token), inter-token latency
p50 / p99 (the gaps between streamed tokens: a step's time as a request sees it, what the
target holds), TTFT p50, and the share of decode steps over the target.

    python benchmarks/tpot_target_table.py benchmarks/results/tpot_target docs/img/tpot_target.png
"""
from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path


def main() -> None:
    outdir = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/tpot_target")
    plot = sys.argv[2] if len(sys.argv) > 2 else None
    by_target: dict[str, list[tuple[dict, dict]]] = {}
    for p in sorted(outdir.glob("target_*_r*.json")):
        target = re.match(r"target_(.+)_r\d+\.json", p.name).group(1)
        run = json.loads(p.read_text())["runs"][0]
        metrics = {}
        mp = p.with_suffix(".metrics")
        if mp.exists():
            for line in mp.read_text().splitlines():
                name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
                metrics[name] = value
        by_target.setdefault(target, []).append((run, metrics))
    order = sorted(by_target, key=lambda t: -float("inf") if t == "none" else -float(t))
    rows = []
    print("| target TPOT | rounds | c32 output tok/s | TPOT p50 ms | inter-token p50 ms | inter-token p99 ms "
          "| TTFT p50 s | decode steps over target |")
    print("|---|---|---|---|---|---|---|---|")
    for t in order:
        runs = by_target[t]
        med = lambda key: statistics.median(r[key] for r, _ in runs)  # noqa: E731
        steps = sum(m.get("sluice_tpot_target_decode_steps_total", 0) for _, m in runs)
        misses = sum(m.get("sluice_tpot_target_misses_total", 0) for _, m in runs)
        over = f"{100 * misses / steps:.1f}%" if steps else "-"
        row = (t, len(runs), med("output_tok_per_s"), 1e3 * med("tpot_p50_s"), 1e3 * med("itl_p50_s"),
               1e3 * med("itl_p99_s"), med("ttft_p50_s"))
        rows.append(row)
        label = "none" if t == "none" else f"{t} ms"
        print(f"| {label} | {row[1]} | {row[2]:.1f} | {row[3]:.1f} | {row[4]:.1f} | {row[5]:.1f} | {row[6]:.2f} "
              f"| {over} |")
    if plot and rows:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r[5] for r in rows], [r[2] for r in rows], marker="o")
        for r in rows:
            ax.annotate("no target" if r[0] == "none" else f"{r[0]} ms", (r[5], r[2]), textcoords="offset points",
                        xytext=(5, 5))
        ax.set(xlabel="inter-token latency p99 (ms)", ylabel="c32 output tokens/s",
               title="--target-tpot-ms: throughput vs token latency")
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main()
