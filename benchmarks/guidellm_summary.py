"""Summarise guidellm (0.8.1) JSON reports, such as benchmarks/guidellm_run.sh writes: per
file (and per benchmark in it, when it holds several) print output tokens/s, TTFT p50,
ITL p50 and TPOT p50, plus the completed/errored request counts.

    python3 benchmarks/guidellm_summary.py REPORT.json [REPORT.json ...] [--markdown]

Fields read, all under report["benchmarks"][i]["metrics"]:
  output tok/s  output_tokens_per_second["total"]["mean"]: output tokens over the
                benchmark's duration, all requests (the "Output Tokens Per Sec" column
                of guidellm's console table)
  TTFT p50      time_to_first_token_ms["successful"]["percentiles"]["p50"]: request
                start to first streamed token, completed requests
  ITL p50       inter_token_latency_ms["successful"]["percentiles"]["p50"]: per request
                (last token - first token) / (output tokens - 1); what vLLM's and
                `sluice bench serve`'s TPOT means
  TPOT p50      time_per_output_token_ms["successful"]["percentiles"]["p50"]: per request
                (last token - request start) / output tokens, so it includes the TTFT
guidellm weights the ITL and TPOT distributions by each request's output tokens; with a
fixed output length (ignore_eos, as guidellm_run.sh asks) that is the per-request median.
Counts: metrics["request_totals"]["successful"] and ["errored"].
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _get(d: dict, *path, default=None):
    for key in path:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return d


def summarise(report: dict) -> list[dict]:
    rows = []
    for bench in report.get("benchmarks", []):
        m = bench["metrics"]
        profile = _get(bench, "config", "strategy") or {}
        streams = profile.get("streams") if isinstance(profile, dict) else None
        rows.append({
            "streams": streams,
            "ok": _get(m, "request_totals", "successful"),
            "errors": _get(m, "request_totals", "errored"),
            "duration_s": bench.get("duration"),
            "out_tok_s": _get(m, "output_tokens_per_second", "total", "mean"),
            "ttft_p50_ms": _get(m, "time_to_first_token_ms", "successful", "percentiles", "p50"),
            "itl_p50_ms": _get(m, "inter_token_latency_ms", "successful", "percentiles", "p50"),
            "tpot_p50_ms": _get(m, "time_per_output_token_ms", "successful", "percentiles", "p50"),
        })
    return rows


def _fmt(v, digits=1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", type=Path, help="guidellm JSON reports")
    ap.add_argument("--markdown", action="store_true", help="print a markdown table")
    args = ap.parse_args(argv)

    cols = ["file", "streams", "ok", "errors", "out tok/s", "TTFT p50 ms", "ITL p50 ms", "TPOT p50 ms"]
    lines = []
    status = 0
    for path in args.reports:
        try:
            rows = summarise(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: cannot read a guidellm report ({e})", file=sys.stderr)
            status = 1
            continue
        for r in rows:
            lines.append([str(path), _fmt(r["streams"]), _fmt(r["ok"]), _fmt(r["errors"]),
                          _fmt(r["out_tok_s"]), _fmt(r["ttft_p50_ms"]), _fmt(r["itl_p50_ms"], 2),
                          _fmt(r["tpot_p50_ms"], 2)])
    if args.markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|")
        for ln in lines:
            print("| " + " | ".join(ln) + " |")
    else:
        widths = [max(len(c), *(len(ln[i]) for ln in lines)) if lines else len(c) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cols, widths))))
        for ln in lines:
            print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(ln, widths))))
    return status


if __name__ == "__main__":
    sys.exit(main())
