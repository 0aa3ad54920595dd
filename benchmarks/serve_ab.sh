#!/usr/bin/env bash
# Served c32 runs of two versions of sluice, alternating (ABBA): a git revision (checked
# out in a temporary worktree, its kernels built in their own extensions folder) and the
# working tree. Each run starts its own server, drives it with `sluice bench serve`
# (CONCURRENCY streams, default 32, REQUESTS requests, default 64; ~210-token prompts, 128
# output tokens) and stops it. BENCH_EXTRA: JSON merged into every request (the load
# generator's --extra-body), e.g. '{"temperature": 1.0}' to sample as clients that send no
# temperature do, instead of its greedy default. Each line also gives the API server
# process's CPU seconds over the measured run (its own, not the engine core's: the two
# share the machine's cores with the load generator).
#   BASE=93da0d7 PAIRS=6 OUT=benchmarks/results/serve_c32/w8a8_kv8/ab1 bash benchmarks/serve_ab.sh \
#       --quantization w8a8 --kv-cache-dtype int8
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=${BASE:?set BASE to a git revision}
PAIRS=${PAIRS:-4}
OUT=${OUT:-benchmarks/results/serve_ab}
PORT=${PORT:-8151}
CONCURRENCY=${CONCURRENCY:-32}
REQUESTS=${REQUESTS:-64}
BENCH_EXTRA=${BENCH_EXTRA:-}
mkdir -p "$OUT"
WT=$(mktemp -d)
git worktree add -f --detach "$WT" "$BASE" > /dev/null
trap 'git worktree remove --force "$WT"' EXIT

run() {  # NAME, then env assignments for the server
  local name=$1; shift
  env "$@" HF_HUB_OFFLINE=1 .venv/bin/python -c \
      "import sys; from sluice.entrypoints.cli import main; sys.exit(main(sys.argv[1:]))" \
      serve --port "$PORT" "${FLAGS[@]}" > "$OUT/$name.log" 2>&1 &
  local server=$!
  until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do sleep 1; done
  local cpu0; cpu0=$(awk '{print $14 + $15}' "/proc/$server/stat")
  .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency "$CONCURRENCY" --requests "$REQUESTS" \
      --input-len 210 --output-len 128 ${BENCH_EXTRA:+--extra-body "$BENCH_EXTRA"} --json "$OUT/$name.json" > /dev/null
  local cpu1; cpu1=$(awk '{print $14 + $15}' "/proc/$server/stat")
  kill -TERM "$server"; wait "$server" || true
  .venv/bin/python -c "import json, os, sys; r = json.load(open(sys.argv[1]))['runs'][0]; \
cpu = (int(sys.argv[4]) - int(sys.argv[3])) / os.sysconf('SC_CLK_TCK'); \
print(sys.argv[2], f\"{r['output_tok_per_s']:.1f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s, TPOT p50 {1e3 * r['tpot_p50_s']:.2f} ms, server CPU {cpu:.2f} s\")" \
      "$OUT/$name.json" "$name" "$cpu0" "$cpu1"
}

FLAGS=("$@")
base() { run "base_$1" PYTHONPATH="$WT/src" TORCH_EXTENSIONS_DIR="$WT/.extensions"; }
tree() { run "tree_$1"; }
for i in $(seq 1 "$PAIRS"); do
  if [ $((i % 2)) -eq 1 ]; then base "$i"; tree "$i"; else tree "$i"; base "$i"; fi
done
