#!/usr/bin/env bash
# The agent sweep served (issue 44): benchmarks/agents.sh's programs experiment over
# loads, cache sizes and workload shapes, the configurations alternating within each
# cell, then one table of every configuration's speed-up on FCFS
# (benchmarks/agents_sweep_table.py). The same grid as agents_sweep.py (the simulator),
# at the cost of real time: a cell is one served run per configuration and round.
#
#   SHAPES=short RATES="1 2 4 8" KV_SIZES="0.1 0.25" bash benchmarks/agents_served_sweep.sh
#
# Shapes (as in agents_sweep.py): short = 96 programs, 90% of 2-3 calls, 60-120-token
# tool results; long = 24 programs of 8-12 calls, 300-600-token tool results.
# Environment: SHAPES [short]  RATES ["1 2 4 8"]  LONG_RATES ["0.05 0.1 0.2 0.4"]
#   KV_SIZES ["0.1 0.25"]  LONG_KV_SIZES ["0.25 0.5"]  ROUNDS [1]
#   CONFIGS ["fcfs fcfs_tier program program_tier"]  OUTDIR [benchmarks/results/agents_served_sweep]
#   and agents.sh's own (TIER_GIB, SEED, SERVE_FLAGS, PORT).
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."
if [ -z "${AGENTS_LOCKED:-}" ]; then
    exec env AGENTS_LOCKED=1 flock /tmp/cpu.lock bash "$SELF" "$@"
fi
SHAPES=${SHAPES:-short}
RATES=${RATES:-1 2 4 8}
LONG_RATES=${LONG_RATES:-0.05 0.1 0.2 0.4}
KV_SIZES=${KV_SIZES:-0.1 0.25}
LONG_KV_SIZES=${LONG_KV_SIZES:-0.25 0.5}
OUTDIR=${OUTDIR:-benchmarks/results/agents_served_sweep}
export ROUNDS=${ROUNDS:-1}
export CONFIGS=${CONFIGS:-fcfs fcfs_tier program program_tier}
export EXPERIMENTS=programs

for shape in $SHAPES; do
    if [ "$shape" = short ]; then
        programs=96; flags="--short-frac 0.9 --tool-len 60,120"; rates=$RATES; sizes=$KV_SIZES
    else
        programs=24; flags="--short-frac 0 --tool-len 300,600"; rates=$LONG_RATES; sizes=$LONG_KV_SIZES
    fi
    for kv in $sizes; do
        for rate in $rates; do
            PROGRAMS=$programs RATE=$rate KV_GIB=$kv BENCH_FLAGS=$flags \
                OUTDIR="$OUTDIR/${shape}_kv${kv}_rate${rate}" bash benchmarks/agents.sh > /dev/null
        done
    done
done
.venv/bin/python benchmarks/agents_sweep_table.py "$OUTDIR"
