"""The table of benchmarks/structured.sh's results: medians over rounds of c32 output tok/s,
TTFT and TPOT p50, free against JSON-schema-constrained, and the grammar counters."""
from __future__ import annotations

import glob
import json
import statistics
import sys

OUT = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/structured"


def runs(cfg: str) -> list[dict]:
    return [json.load(open(p))["runs"][0] for p in sorted(glob.glob(f"{OUT}/{cfg}_r*.json"))]


def counters(path: str) -> dict[str, float]:
    out = {}
    for line in open(path):
        name, value = line.split()[0].split("{")[0], float(line.split()[-1])
        out[name] = value
    return out


med = statistics.median
rows = {cfg: runs(cfg) for cfg in ("free", "json")}
print("| requests | rounds | c32 output tok/s | c32 TTFT p50 (ms) | c32 TPOT p50 (ms) | failed |")
print("|---|---|---|---|---|---|")
for cfg, rs in rows.items():
    print(f"| {'free' if cfg == 'free' else 'every one JSON-schema constrained'} | {len(rs)} | "
          f"{med(r['output_tok_per_s'] for r in rs):.1f} | {1e3 * med(r['ttft_p50_s'] for r in rs):.0f} | "
          f"{1e3 * med(r['tpot_p50_s'] for r in rs):.1f} | {sum(r['failed'] for r in rs)} |")
free, js = (med(r["output_tok_per_s"] for r in rows[c]) for c in ("free", "json"))
print(f"\ncost: {100 * (1 - js / free):.1f}% of free throughput (medians)")
last = sorted(glob.glob(f"{OUT}/json_r*.metrics"))[-1]
c = counters(last)
rows_masked = c.get("sluice_grammar_rows_total", 0)
if rows_masked:
    print(f"grammar counters after {len(rows['json'])} constrained runs ({last}): {rows_masked:.0f} rows masked; "
          f"mask filling {1e3 * c['sluice_grammar_mask_fill_seconds_total'] / rows_masked:.3f} ms per row on the "
          f"mask thread; steps waited {1e3 * c['sluice_grammar_mask_wait_seconds_total'] / rows_masked:.3f} ms "
          f"per row; {c['sluice_grammar_compiles_total']:.0f} compile(s), "
          f"{1e3 * c['sluice_grammar_compile_seconds_total'] / max(1, c['sluice_grammar_compiles_total']):.1f} ms each")
