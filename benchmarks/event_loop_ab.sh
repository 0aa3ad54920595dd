#!/usr/bin/env bash
# The API server on asyncio's loop and h11 (A: uvloop and httptools hidden from uvicorn,
# which runs on them where they are installed) against uvloop and httptools (B), the same
# tree, alternating (ABBA per pair). Each run starts `sluice serve` (with the flags given),
# drives it with `sluice bench serve` (CONCURRENCY streams, default 1; REQUESTS requests,
# default 8; ~210-token prompts, 128 output tokens) and prints output tok/s, TPOT p50 and
# the API server process's own CPU seconds over the measured run.
#   CONCURRENCY=32 REQUESTS=64 PAIRS=2 bash benchmarks/event_loop_ab.sh --speculative-method off
set -euo pipefail
cd "$(dirname "$0")/.."
PAIRS=${PAIRS:-2}
CONCURRENCY=${CONCURRENCY:-1}
REQUESTS=${REQUESTS:-8}
PORT=${PORT:-8161}
OUT=${OUT:-benchmarks/results/event_loop_ab}
mkdir -p "$OUT"

run() {  # NAME HIDE(1: asyncio + h11)
  local name=$1 hide=$2
  shift 2
  HF_HUB_OFFLINE=1 .venv/bin/python -c "
import sys
if sys.argv[1] == '1':  # an import of either now fails, and uvicorn falls back to asyncio and h11
    sys.modules['uvloop'] = None
    sys.modules['httptools'] = None
from sluice.entrypoints.cli import main
sys.exit(main(sys.argv[2:]))" "$hide" serve --port "$PORT" "$@" > "$OUT/$name.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  local cpu0; cpu0=$(awk '{print $14 + $15}' "/proc/$server/stat")
  .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
      --input-len 210 --output-len 128 --json "$OUT/$name.json" > /dev/null
  local cpu1; cpu1=$(awk '{print $14 + $15}' "/proc/$server/stat")
  kill -TERM "$server"; wait "$server" || true
  .venv/bin/python -c "import json, os, sys; r = json.load(open(sys.argv[1]))['runs'][0]; \
cpu = (int(sys.argv[3]) - int(sys.argv[2])) / os.sysconf('SC_CLK_TCK'); \
print(sys.argv[4], 'tok/s %.1f' % r['output_tok_per_s'], 'TPOT p50 %.2f ms' % (1e3 * r['tpot_p50_s']), \
'server CPU %.2f s' % cpu, 'failed %d' % r['failed'])" "$OUT/$name.json" "$cpu0" "$cpu1" "$name"
}

for i in $(seq 1 "$PAIRS"); do
  if (( i % 2 )); then order="A B"; else order="B A"; fi
  for x in $order; do
    if [ "$x" = A ]; then run "asyncio_h11_$i" 1 "$@"; else run "uvloop_httptools_$i" 0 "$@"; fi
  done
done
