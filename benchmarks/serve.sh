#!/usr/bin/env bash
# Serving benchmark: start `sluice serve` on the default model (bf16), drive it with
# `sluice bench serve` at concurrency 1, 8 and 32, then stop it.
#   bash benchmarks/serve.sh [extra sluice serve flags]
#   OUT=benchmarks/results/serve/int8 PLOT=/tmp/x.png CONC=1 REQS=16 bash benchmarks/serve.sh --quantization int8
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8123}
OUT=${OUT:-benchmarks/results/serve/bf16}
PLOT=${PLOT:-docs/img/serve.png}
CONC=${CONC:-1,8,32}
REQS=${REQS:-16,64,64}
# Appending (O_APPEND), so that the VmHWM line added at the end is not overwritten by
# the server's own later log lines (it keeps writing while it shuts down).
: > "$OUT.log"
.venv/bin/sluice serve --port "$PORT" "$@" >> "$OUT.log" 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
.venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONC" --requests "$REQS" \
    --input-len 210 --output-len 128 --json "$OUT.json" --plot "$PLOT"
# The server's peak resident memory over the run (weights, KV cache, everything else).
grep VmHWM "/proc/$SERVER/status" | tee -a "$OUT.log"
