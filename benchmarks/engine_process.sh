#!/usr/bin/env bash
# The engine core in the server's process (a thread) against in a process of its own
# (`--engine-process`), served, alternating (ABBA), one server per mode and round: each
# takes `sluice bench serve` at c1 (8 requests) then c32 (64 requests), ~210-token
# prompts and 128 output tokens. Extra arguments go to both servers.
#   ROUNDS=3 OUT=benchmarks/results/engine_process bash benchmarks/engine_process.sh
# Then: python benchmarks/engine_process_table.py benchmarks/results/engine_process
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${ROUNDS:-3}
OUT=${OUT:-benchmarks/results/engine_process}
PORT=${PORT:-8161}
mkdir -p "$OUT"
exec 9> /tmp/cpu.lock
flock 9  # one heavy job at a time on the box

run() {  # NAME, then server flags
  local name=$1; shift
  HF_HUB_OFFLINE=1 .venv/bin/sluice serve --port "$PORT" "$@" "${FLAGS[@]}" > "$OUT/$name.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency 1,32 --requests 8,64 \
      --input-len 210 --output-len 128 --json "$OUT/$name.json" > /dev/null
  kill -TERM "$server"; wait "$server" || true
  .venv/bin/python -c "import json, sys
for r in json.load(open(sys.argv[1]))['runs']:
    print(sys.argv[2], f\"c{r['concurrency']}: {r['output_tok_per_s']:.1f} tok/s, TPOT p50 {1e3 * r['tpot_p50_s']:.2f} ms\")" \
      "$OUT/$name.json" "$name"
}

FLAGS=("$@")
for i in $(seq 1 "$ROUNDS"); do
  if [ $((i % 2)) -eq 1 ]; then run "thread_$i"; run "process_$i" --engine-process
  else run "process_$i" --engine-process; run "thread_$i"; fi
done
