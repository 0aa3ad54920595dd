#!/usr/bin/env bash
# The latency target as a setting: the served c32 workload (`sluice bench serve`, ~210-token
# prompts, 128 outputs, 64 requests) on `sluice serve --target-tpot-ms T` for several T
# and without a target, alternating round by round; then the table and the plot of output
# tok/s against TPOT p99 (benchmarks/tpot_target_table.py). Each server's
# sluice_tpot_target_misses_total is read from /metrics after its run.
#
#   bash benchmarks/tpot_target.sh
#   TARGETS="none 40" ROUNDS=1 SERVE_FLAGS="--quantization w8a8" bash benchmarks/tpot_target.sh
#
# Environment: PORT [8126]  ROUNDS [2]  TARGETS ["none 120 80 50"]  OUTDIR
#   [benchmarks/results/tpot_target]  PLOT [docs/img/tpot_target.png]  SERVE_FLAGS []
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
if [ -z "${TPOT_LOCKED:-}" ]; then
    exec env TPOT_LOCKED=1 flock /tmp/cpu.lock bash "$SELF" "$@"
fi
PORT=${PORT:-8126}
ROUNDS=${ROUNDS:-2}
TARGETS=${TARGETS:-none 120 80 50}
OUTDIR=${OUTDIR:-benchmarks/results/tpot_target}
PLOT=${PLOT:-docs/img/tpot_target.png}
SERVE_FLAGS=${SERVE_FLAGS:-}
export HF_HUB_OFFLINE=1
mkdir -p "$OUTDIR"
. benchmarks/sluice_server.sh
for r in $(seq 1 "$ROUNDS"); do
    for t in $TARGETS; do
        name=$OUTDIR/target_${t}_r$r
        flags=()
        [ "$t" = none ] || flags=(--target-tpot-ms "$t")
        echo "[tpot_target $(date +%H:%M:%S)] round $r: target $t" >&2
        # shellcheck disable=SC2086
        start_server "$name.log" $SERVE_FLAGS "${flags[@]}"
        .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" --concurrency 32 --requests 64 \
            --input-len 210 --output-len 128 --seed "$r" --json "$name.json" > /dev/null
        curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sluice_tpot_target_(misses|decode_steps)_total' \
            > "$name.metrics" || true
        stop_server
    done
done
.venv/bin/python benchmarks/tpot_target_table.py "$OUTDIR" "$PLOT"
