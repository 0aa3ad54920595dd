#!/usr/bin/env bash
# The API server on asyncio's loop and h11 (uvloop and httptools hidden from uvicorn, which
# runs on them where they are installed) against uvloop and httptools, the same tree,
# alternating (AB, then BA). Each run is benchmarks/serve_run.sh's: `sluice serve` with the
# flags given, CONCURRENCY streams (default 1), REQUESTS requests (default 8).
#   CONCURRENCY=32 REQUESTS=64 PAIRS=2 bash benchmarks/event_loop_ab.sh --speculative-method off
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=${PAIRS:-2}
CONCURRENCY=${CONCURRENCY:-1}
REQUESTS=${REQUESTS:-8}
BENCH_EXTRA=${BENCH_EXTRA:-}
PORT=${PORT:-8161}
OUT=${OUT:-benchmarks/results/event_loop_ab}
mkdir -p "$OUT"
# Modules that fail to import, first on the server's path: uvicorn falls back as if the
# packages were not installed.
HIDE=$(mktemp -d)
trap 'rm -rf "$HIDE"' EXIT
for m in uvloop httptools; do echo 'raise ImportError("hidden by benchmarks/event_loop_ab.sh")' > "$HIDE/$m.py"; done

source benchmarks/serve_run.sh

FLAGS=("$@")
asyncio_h11() { run "asyncio_h11_$1" PYTHONPATH="$HIDE"; }
uvloop_httptools() { run "uvloop_httptools_$1"; }
for i in $(seq 1 "$PAIRS"); do
  if [ $((i % 2)) -eq 1 ]; then asyncio_h11 "$i"; uvloop_httptools "$i"; else uvloop_httptools "$i"; asyncio_h11 "$i"; fi
done
