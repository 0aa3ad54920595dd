#!/usr/bin/env bash
# Agent programs (`sluice bench agents`) against `sluice serve`, in one sitting, the
# configurations alternating round by round. Two experiments:
#
#  programs: the same seeded agent load on
#    fcfs      `--scheduling-policy fcfs`, calls without session_id (today's engines:
#              prefix caching on, its blocks evicted by LRU during tool calls)
#    program   `--scheduling-policy program`, calls with session_id (pinned KV, warm calls
#              first, PLAS, the door for new programs)
#    fcfs_tier, program_tier   the same with a host KV tier of TIER_GIB GiB
#              (`--kv-offload-memory`): evicted blocks reloaded instead of recomputed
#  fairness: one light tenant's programs,
#    alone     by themselves (its baseline), on `--scheduling-policy fair`
#    fair      beside a heavy tenant sending HEAVY times its programs, on `fair`
#    fcfs      the same mix on `fcfs`
#
#   bash benchmarks/agents.sh                      # both experiments, ROUNDS rounds each
#   EXPERIMENTS=programs ROUNDS=1 bash benchmarks/agents.sh
#
# The KV cache is KV_GIB GiB (default 0.25, ~11k tokens of SmolLM2), so that the agents'
# histories do not all fit at once: the regime where keeping a program's KV across its
# tool calls is a decision at all. Holds `flock /tmp/cpu.lock` for the whole sitting.
#
# Environment: PORT [8125]  ROUNDS [2]  OUTDIR [benchmarks/results/agents]  KV_GIB [0.25]
#   PROGRAMS [24]  RATE [0.5 programs/s]  HEAVY [10]  LIGHT_PROGRAMS [4]
#   FAIR_RATE [1.0 programs/s, light and heavy together]  SEED [0]
#   SERVE_FLAGS [extra flags for every server]  EXPERIMENTS ["programs fairness"]
#   CONFIGS ["fcfs program": the programs experiment's configurations]  TIER_GIB [1]
#   BENCH_FLAGS [extra `sluice bench agents` flags of the programs experiment: its shape]
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
if [ -z "${AGENTS_LOCKED:-}" ]; then
    exec env AGENTS_LOCKED=1 flock /tmp/cpu.lock bash "$SELF" "$@"
fi
PORT=${PORT:-8125}
ROUNDS=${ROUNDS:-2}
OUTDIR=${OUTDIR:-benchmarks/results/agents}
KV_GIB=${KV_GIB:-0.25}
PROGRAMS=${PROGRAMS:-24}
RATE=${RATE:-0.5}
HEAVY=${HEAVY:-10}
LIGHT_PROGRAMS=${LIGHT_PROGRAMS:-4}
FAIR_RATE=${FAIR_RATE:-1.0}
SEED=${SEED:-0}
SERVE_FLAGS=${SERVE_FLAGS:-}
BENCH_FLAGS=${BENCH_FLAGS:-}
EXPERIMENTS=${EXPERIMENTS:-programs fairness}
CONFIGS=${CONFIGS:-fcfs program}
TIER_GIB=${TIER_GIB:-1}
export HF_HUB_OFFLINE=1
mkdir -p "$OUTDIR"
log() { echo "[agents $(date +%H:%M:%S)] $*" >&2; }

. benchmarks/sluice_server.sh
kv_server() {  # LOG FLAGS...: every server of this sitting gets the same cache and SERVE_FLAGS
    local logf=$1; shift
    # shellcheck disable=SC2086
    start_server "$logf" --kv-cache-memory "$KV_GIB" $SERVE_FLAGS "$@"
}
bench() {  # OUT.json ARGS...   (then the server's session and preemption counters, OUT.metrics)
    local out=$1; shift
    # (Exit 1 means some call failed: the report counts them; the sitting goes on.)
    .venv/bin/sluice bench agents --url "http://127.0.0.1:$PORT" --seed "$SEED" --json "$out" "$@" > /dev/null \
        || log "some calls failed: see failed_calls in $out"
    curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^sluice_(session_events_total|num_preemptions_total|prefix_cache_(hits|queries)_total|kv_offload_)' \
        > "${out%.json}.metrics" || true
}

for r in $(seq 1 "$ROUNDS"); do
    for exp in $EXPERIMENTS; do
        if [ "$exp" = programs ]; then
            for cfg in $CONFIGS; do
                log "round $r: programs/$cfg"
                name=$OUTDIR/programs_${cfg}_r$r
                tier=()
                if [[ "$cfg" == *_tier ]]; then
                    tier=(--kv-offload-memory "$TIER_GIB")
                fi
                if [[ "$cfg" == fcfs* ]]; then
                    kv_server "$name.log" --scheduling-policy fcfs "${tier[@]}"
                    # shellcheck disable=SC2086
                    bench "$name.json" --programs "$PROGRAMS" --program-rate "$RATE" $BENCH_FLAGS
                else
                    kv_server "$name.log" --scheduling-policy program "${tier[@]}"
                    # shellcheck disable=SC2086
                    bench "$name.json" --programs "$PROGRAMS" --program-rate "$RATE" --sessions $BENCH_FLAGS
                fi
                stop_server
            done
        elif [ "$exp" = fairness ]; then
            # The light tenant's programs are the same in all three (same seed, same share
            # draw): --only-tenant keeps them alone.
            mix=(--programs $((LIGHT_PROGRAMS * (HEAVY + 1))) --program-rate "$FAIR_RATE" --tenant light=1
                 --tenant "heavy=$HEAVY" --sessions)
            for cfg in alone fair fcfs; do
                log "round $r: fairness/$cfg"
                name=$OUTDIR/fairness_${cfg}_r$r
                if [ "$cfg" = fcfs ]; then
                    kv_server "$name.log" --scheduling-policy fcfs
                else
                    kv_server "$name.log" --scheduling-policy fair
                fi
                if [ "$cfg" = alone ]; then
                    bench "$name.json" "${mix[@]}" --only-tenant light
                else
                    bench "$name.json" "${mix[@]}"
                fi
                stop_server
            done
        fi
    done
done
.venv/bin/python benchmarks/agents_table.py "$OUTDIR"
