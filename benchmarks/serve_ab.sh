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

source benchmarks/serve_run.sh

FLAGS=("$@")
base() { run "base_$1" PYTHONPATH="$WT/src" TORCH_EXTENSIONS_DIR="$WT/.extensions"; }
tree() { run "tree_$1"; }
for i in $(seq 1 "$PAIRS"); do
  if [ $((i % 2)) -eq 1 ]; then base "$i"; tree "$i"; else tree "$i"; base "$i"; fi
done
