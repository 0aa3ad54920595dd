"""Markdown table of a benchmarks/side_by_side.sh sitting: per configuration, the median
over rounds of c32 output tok/s, c32 TTFT p50, c32 TPOT p50 and c1 TPOT p50.

    python benchmarks/side_by_side_table.py OUTDIR [--high 32] [--low 1] [NAME ...]

Reads OUTDIR/<name>_r<round>_c<conc>.json (`sluice bench serve --json` reports; the
first run of each). NAMEs give the row order; without them, every name found, sorted.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
from collections import defaultdict
from pathlib import Path

PATTERN = re.compile(r"^(?P<name>.+)_r(?P<round>\d+)_c(?P<conc>\d+)\.json$")


def load(outdir: Path) -> dict[str, dict[int, dict[int, dict]]]:
    """name -> concurrency -> round -> run summary."""
    found: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for f in sorted(outdir.glob("*.json")):
        m = PATTERN.match(f.name)
        if not m:
            continue
        runs = json.loads(f.read_text())["runs"]
        if runs:
            found[m["name"]][int(m["conc"])][int(m["round"])] = runs[0]
    return found


def median(runs: dict[int, dict], key: str, scale: float = 1.0) -> str:
    values = [r[key] for r in runs.values() if r.get(key) is not None]
    if not values:
        return "–"
    return f"{statistics.median(values) * scale:.1f}"


def table(found, names: list[str], high: int, low: int) -> str:
    header = (f"| config | rounds | c{high} output tok/s | c{high} TTFT p50 (ms) | c{high} TPOT p50 (ms) "
              f"| c{low} TPOT p50 (ms) | failed requests |")
    lines = [header, "|---|---|---|---|---|---|---|"]
    for name in names:
        hi, lo = found.get(name, {}).get(high, {}), found.get(name, {}).get(low, {})
        rounds = max(len(hi), len(lo))
        failed = sum(r.get("failed", 0) for r in list(hi.values()) + list(lo.values()))
        lines.append(f"| {name} | {rounds} | {median(hi, 'output_tok_per_s')} | {median(hi, 'ttft_p50_s', 1e3)} "
                     f"| {median(hi, 'tpot_p50_s', 1e3)} | {median(lo, 'tpot_p50_s', 1e3)} | {failed} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir", type=Path)
    p.add_argument("names", nargs="*")
    p.add_argument("--high", type=int, default=32, help="the many-client concurrency (default 32)")
    p.add_argument("--low", type=int, default=1, help="the single-client concurrency (default 1)")
    args = p.parse_intermixed_args()
    found = load(args.outdir)
    print(table(found, args.names or sorted(found), args.high, args.low))


if __name__ == "__main__":
    main()
