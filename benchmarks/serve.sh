#!/usr/bin/env bash
# Serving benchmark: start `sluice serve` on the default model (bf16), drive it with
# `sluice bench serve` at concurrency 1, 8 and 32, then stop it.
#   bash benchmarks/serve.sh [extra sluice serve flags]
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8123}
.venv/bin/sluice serve --port "$PORT" "$@" > benchmarks/results/serve.log 2>&1 &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
.venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency 1,8,32 --requests 16,64,64 \
    --input-len 210 --output-len 128 --json benchmarks/results/serve.json --plot docs/img/serve.png
