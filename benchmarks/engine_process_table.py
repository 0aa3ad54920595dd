"""The table of benchmarks/engine_process.sh's runs: per mode and concurrency, the median
over rounds of output tokens/s, TPOT p50 and TTFT p50, and process / thread.

    python benchmarks/engine_process_table.py benchmarks/results/engine_process [more folders]
"""
from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main() -> int:
    runs: dict[tuple[str, int], list[dict]] = {}
    for folder in sys.argv[1:]:
        for f in sorted(Path(folder).glob("*.json")):
            mode = f.stem.split("_")[0]
            for r in json.loads(f.read_text())["runs"]:
                runs.setdefault((mode, r["concurrency"]), []).append(r)
    print("| concurrency | engine | rounds | output tok/s (median) | TPOT p50 (ms) | TTFT p50 (ms) | tok/s each round |")
    print("|---|---|---|---|---|---|---|")
    for c in sorted({c for _, c in runs}):
        med = {}
        for mode in ("thread", "process"):
            rs = runs.get((mode, c), [])
            if not rs:
                continue
            tok = statistics.median(r["output_tok_per_s"] for r in rs)
            med[mode] = tok
            print(f"| c{c} | {mode} | {len(rs)} | {tok:.1f} | {1e3 * statistics.median(r['tpot_p50_s'] for r in rs):.2f} | "
                  f"{1e3 * statistics.median(r['ttft_p50_s'] for r in rs):.0f} | "
                  f"{', '.join(format(r['output_tok_per_s'], '.0f') for r in rs)} |")
        if len(med) == 2:
            print(f"| c{c} | process / thread | | {med['process'] / med['thread']:.3f}x | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
