"""Markdown table of a benchmarks/side_by_side.sh sitting: per configuration, the median
over rounds of c32 output tok/s, c32 TTFT p50, c32 TPOT p50 and c1 TPOT p50.

    python benchmarks/side_by_side_table.py OUTDIR [--high 32] [--low 1] [NAME ...]

Reads OUTDIR/<name>_r<round>_c<conc>.json (`sluice bench serve --json` reports; the
first run of each). NAMEs give the row order; without them, every name found, sorted.
Where the sitting also ran guidellm (GUIDELLM=1: OUTDIR/<name>_r<round>_g<conc>.json), a
second table gives its c32 output tok/s, c32 TTFT p50 and ITL p50 and c1 ITL p50 (its
ITL is what our client and vLLM call TPOT; benchmarks/guidellm_summary.py).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # guidellm_summary beside this file
PATTERN = re.compile(r"^(?P<name>.+)_r(?P<round>\d+)_(?P<client>[cg])(?P<conc>\d+)\.json$")


def load(outdir: Path, client: str = "c") -> dict[str, dict[int, dict[int, dict]]]:
    """name -> concurrency -> round -> run summary; client "c" (ours) or "g" (guidellm,
    in our summary's keys and units)."""
    found: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for f in sorted(outdir.glob("*.json")):
        m = PATTERN.match(f.name)
        if not m or m["client"] != client:
            continue
        if client == "c":
            runs = json.loads(f.read_text())["runs"]
        else:
            from guidellm_summary import summarise
            runs = [{"output_tok_per_s": r["out_tok_s"], "failed": r["errors"] or 0,
                     "ttft_p50_s": r["ttft_p50_ms"] / 1e3 if r["ttft_p50_ms"] is not None else None,
                     "tpot_p50_s": r["itl_p50_ms"] / 1e3 if r["itl_p50_ms"] is not None else None}
                    for r in summarise(json.loads(f.read_text()))]
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
    guided = load(args.outdir, "g")
    if guided:
        print("\nguidellm (TPOT columns: its ITL):\n")
        print(table(guided, [n for n in (args.names or sorted(guided)) if n in guided], args.high, args.low))


if __name__ == "__main__":
    main()
