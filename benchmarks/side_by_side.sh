#!/usr/bin/env bash
# Served side-by-side of llama.cpp's llama-server and sluice, in one sitting, alternating
# engines, on the same workload: for each round and each configuration in order, start
# its server on $PORT, wait for /health, drive it with `sluice bench serve` (closed loop,
# ~210-token prompts, 128 output tokens with ignore_eos, streaming /v1/completions) at 32
# clients x 64 requests and then 1 client x 8 requests, stop it, go on. At the end it
# prints a markdown table (benchmarks/side_by_side_table.py): per configuration the median
# over rounds of c32 output tok/s, c32 TTFT p50, c32 TPOT p50 and c1 TPOT p50.
#
#   ISA=avx2 bash benchmarks/llamacpp_build.sh   # once, beforehand (build + models)
#   bash benchmarks/side_by_side.sh
#   ROUNDS=3 ISA=native SLUICE_CONFIGS="--quantization w8a8;" bash benchmarks/side_by_side.sh
#   ONLY='^llamacpp' bash benchmarks/side_by_side.sh   # a subset (regex on the names)
#
# The whole sitting holds an exclusive `flock /tmp/cpu.lock` (LOCK to change it): the
# script re-executes itself under the lock, so it waits for anything else holding it and
# nothing that takes the same lock runs beside it. Run nothing else on the machine then.
#
# Environment (defaults in brackets):
#   SCRATCH [/tmp/scratch/llamacpp]  ISA [avx2]  BIN [the llama.cpp build-$ISA/bin]
#   MODELS [$SCRATCH/models]  PORT [8124]  ROUNDS [2]  THREADS [2, llama-server -t]
#   OUTDIR [benchmarks/results/side_by_side]  C_HIGH/R_HIGH [32/64]  C_LOW/R_LOW [1/8]
#   INPUT_LEN [210]  OUTPUT_LEN [128]  SEED [0]  WARMUP [1: one 8-token request first]
#   BENCH_MODEL [smollm2-135m; the model name the client sends and whose tokenizer sizes
#               the prompts: gemma3-270m beside SLUICE_CONFIGS="--model gemma3-270m ..."]
#   WORKLOAD [standard; repetitive: `sluice bench serve --workload repetitive`, chat prompts
#            whose answers repeat their context, for speculative decoding]
#   EXTRA_BODY [none; JSON added to every request, e.g. '{"ignore_eos": false}']
#   LLAMACPP_TYPES ["F32 BF16 Q8_0 Q4_1"; "" runs no llama.cpp]  HEALTH_TIMEOUT [600 s]
#   ONLY [all]  FORCE_CLOSE [1: a new connection per request, see below]
#   EXTRA_CONFIGS [none: more "name|command" entries, one a line, run after the others]
#   DRY_RUN [unset; set: print each configuration's command and exit, no lock taken]
#   GUIDELLM [0; 1: after our client, guidellm 0.8.1 (benchmarks/guidellm_run.sh; its venv
#            and the model's HF folder beforehand) at the same two concurrencies and counts,
#            reports in $OUTDIR/<name>_r<round>_g<conc>.json]
#   CLIENT_CPUS [1: the clients' cores (taskset) for a configuration whose name ends in
#               "_pinned"; its command pins the server itself, e.g. "taskset -c 0 ..."]
#   SLUICE_CONFIGS ["--cpu-isa avx2;--cpu-isa avx2 --quantization w8a8;
#                    --cpu-isa avx2 --quantization int8"]  (';'-separated flag strings
#                   for `sluice serve`; an empty entry or "default" is sluice's defaults,
#                   SLUICE_CONFIGS="" runs no sluice configuration)
#
# Same workload for all: every server gets the same prompts (--seed $SEED for c32,
# $SEED+1000 for c1, so that the c1 prompts are not c32's first 8, which sluice's prefix
# cache would then serve while llama-server runs with --no-cache-prompt). The model name
# in the requests is the client's default (smollm2-135m); llama-server accepts any name,
# and the prompts are sized with sluice's tokenizer of the same model (llama.cpp's GGUF
# carries the same vocabulary). The warm-up request (WARMUP=1, its own seed) takes the
# first-request costs out of the measured runs for both engines alike.
#
# Results: $OUTDIR/<name>_r<round>_c<conc>.json (the client's reports) and
# $OUTDIR/<name>_r<round>.log (the server's output, then its peak RSS, VmHWM).
set -euo pipefail
SELF=$(realpath "$0")
cd "$(dirname "$SELF")/.."

SCRATCH=${SCRATCH:-/tmp/scratch/llamacpp}
ISA=${ISA:-avx2}
BIN=${BIN:-$SCRATCH/llama_cpp_python-0.3.36/vendor/llama.cpp/build-$ISA/bin}
MODELS=${MODELS:-$SCRATCH/models}
PORT=${PORT:-8124}
ROUNDS=${ROUNDS:-2}
THREADS=${THREADS:-2}
OUTDIR=${OUTDIR:-benchmarks/results/side_by_side}
C_HIGH=${C_HIGH:-32}; R_HIGH=${R_HIGH:-64}
C_LOW=${C_LOW:-1};    R_LOW=${R_LOW:-8}
INPUT_LEN=${INPUT_LEN:-210}
WORKLOAD=${WORKLOAD:-standard}
OUTPUT_LEN=${OUTPUT_LEN:-128}
BENCH_MODEL=${BENCH_MODEL:-smollm2-135m}
SEED=${SEED:-0}
WARMUP=${WARMUP:-1}
HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-600}
ONLY=${ONLY:-}
FORCE_CLOSE=${FORCE_CLOSE:-1}
LLAMACPP_TYPES=${LLAMACPP_TYPES-F32 BF16 Q8_0 Q4_1}
SLUICE_CONFIGS=${SLUICE_CONFIGS-"--cpu-isa avx2;--cpu-isa avx2 --quantization w8a8;--cpu-isa avx2 --quantization int8"}
export PORT BIN MODELS THREADS HF_HUB_OFFLINE=1

log() { echo "[side_by_side $(date +%H:%M:%S)] $*" >&2; }

# "name|command that starts a server on $PORT" ($PORT, $BIN, $MODELS and $THREADS are
# expanded when it starts). llama-server: 32 slots over one unified 16384-token KV cache
# (-kvu; 32 x ~340 tokens fit), continuous batching, 2 threads, no prompt cache.
CONFIGS=()
for t in $LLAMACPP_TYPES; do
    CONFIGS+=("llamacpp_$t|\$BIN/llama-server -m \$MODELS/SmolLM2-135M-Instruct.$t.gguf --host 127.0.0.1 --port \$PORT -c 16384 --parallel 32 -cb -t \$THREADS -kvu --no-cache-prompt")
done
SLUICE_FLAGS=()
rest=$SLUICE_CONFIGS
while [ -n "$SLUICE_CONFIGS" ]; do  # split on ';', keeping empty entries
    SLUICE_FLAGS+=("${rest%%;*}")
    [[ "$rest" == *';'* ]] || break
    rest=${rest#*;}
done
for flags in ${SLUICE_FLAGS[@]+"${SLUICE_FLAGS[@]}"}; do
    flags=$(echo "$flags" | xargs)  # trim
    [ "$flags" = default ] && flags=
    name=sluice_$(echo "${flags:-default}" | sed -E 's/(^| )--/\1/g; s/[^A-Za-z0-9.=-]+/_/g')
    CONFIGS+=("$name|.venv/bin/sluice serve --host 127.0.0.1 --port \$PORT $flags")
done
while IFS= read -r line; do
    [ -n "$line" ] && CONFIGS+=("$line")
done <<< "${EXTRA_CONFIGS:-}"
if [ -n "$ONLY" ]; then
    kept=()
    for c in "${CONFIGS[@]}"; do [[ "${c%%|*}" =~ $ONLY ]] && kept+=("$c"); done
    CONFIGS=("${kept[@]}")
fi
[ "${#CONFIGS[@]}" -gt 0 ] || { echo "no configurations" >&2; exit 2; }
for c in "${CONFIGS[@]}"; do
    if [[ "$c" == llamacpp_* ]]; then
        [ -x "$BIN/llama-server" ] || { echo "no $BIN/llama-server: run benchmarks/llamacpp_build.sh" >&2; exit 1; }
        m=$(echo "$c" | grep -o 'SmolLM2-135M-Instruct\.[A-Za-z0-9_]*\.gguf' || true)  # (EXTRA_CONFIGS: any file)
        [ -z "$m" ] || [ -e "$MODELS/$m" ] || { echo "no $MODELS/$m: run benchmarks/llamacpp_build.sh" >&2; exit 1; }
    fi
done
if [ -n "${DRY_RUN:-}" ]; then
    for c in "${CONFIGS[@]}"; do echo "${c%%|*}: $(eval echo "${c#*|}")"; done
    exit 0
fi

LOCK=${LOCK:-/tmp/cpu.lock}
if [ -z "${SIDE_BY_SIDE_LOCKED:-}" ]; then
    log "waiting for $LOCK"
    exec env SIDE_BY_SIDE_LOCKED=1 flock "$LOCK" bash "$SELF" "$@"
fi
log "holding $LOCK"
if curl -s -o /dev/null "http://127.0.0.1:$PORT/health"; then
    echo "something already listens on port $PORT" >&2; exit 1
fi
mkdir -p "$OUTDIR"

SERVER=
stop_server() {
    [ -n "$SERVER" ] || return 0
    kill -TERM "$SERVER" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
    kill -KILL "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
    SERVER=
}
trap stop_server EXIT

# With FORCE_CLOSE=1, `sluice bench serve --new-connections`: a new connection for every
# request, for all engines alike. llama-server (cpp-httplib) answers a stream with
# "Keep-Alive" but closes the connection after it; the client puts the connection back in
# its pool first and its next request on it fails ("ClientOSError: Can not write request
# body"): 2 of 6 requests at c1 and 2 of 6 at c2 in a check without this, none with it. A
# new localhost connection per request costs well under a millisecond.
GUIDELLM=${GUIDELLM:-0}
CLIENT_CPUS=${CLIENT_CPUS:-1}
PIN=()   # the clients' taskset, set per configuration
bench() {  # OUT.json CONCURRENCY REQUESTS OUTPUT_LEN SEED
    local extra=()
    [ "$FORCE_CLOSE" = 1 ] && extra=(--new-connections)
    [ -n "${EXTRA_BODY:-}" ] && extra+=(--extra-body "$EXTRA_BODY")
    ${PIN[@]+"${PIN[@]}"} .venv/bin/sluice bench serve --url "http://127.0.0.1:$PORT" "${extra[@]}" \
        --concurrency "$2" --requests "$3" --input-len "$INPUT_LEN" --output-len "$4" --seed "$5" --json "$1" \
        --workload "$WORKLOAD" --model "$BENCH_MODEL" --tokenizer "$BENCH_MODEL"
}

NAMES=()
for c in "${CONFIGS[@]}"; do NAMES+=("${c%%|*}"); done
log "configurations: ${NAMES[*]}; $ROUNDS rounds; c$C_HIGH x $R_HIGH and c$C_LOW x $R_LOW"
FAILED=0
for round in $(seq 1 "$ROUNDS"); do
    for c in "${CONFIGS[@]}"; do
        name=${c%%|*}; cmd=${c#*|}
        PIN=(); [[ "$name" == *_pinned ]] && PIN=(taskset -c "$CLIENT_CPUS")
        srvlog=$OUTDIR/${name}_r${round}.log
        log "round $round: $name: $(eval echo "$cmd")"
        bash -c "exec $cmd" > "$srvlog" 2>&1 &
        SERVER=$!
        waited=0
        until curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; do
            if ! kill -0 "$SERVER" 2>/dev/null || [ "$waited" -ge "$HEALTH_TIMEOUT" ]; then
                break
            fi
            sleep 1; waited=$((waited + 1))
        done
        if ! curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then
            log "$name did not become healthy, skipped; the end of $srvlog:"; tail -20 "$srvlog" >&2
            stop_server; FAILED=1
            continue
        fi
        if [ "$WARMUP" -gt 0 ]; then
            bench /dev/null 1 "$WARMUP" 8 $((SEED + 99999)) > /dev/null || true
        fi
        for run in "$C_HIGH $R_HIGH $SEED" "$C_LOW $R_LOW $((SEED + 1000))"; do
            read -r conc reqs seed <<< "$run"
            out=$OUTDIR/${name}_r${round}_c${conc}.json
            if ! bench "$out" "$conc" "$reqs" "$OUTPUT_LEN" "$seed" > /dev/null; then
                log "$name c$conc: some requests failed (see $out)"; FAILED=1
            fi
        done
        if [ "$GUIDELLM" = 1 ]; then
            for run in "$C_HIGH $R_HIGH" "$C_LOW $R_LOW"; do
                read -r conc reqs <<< "$run"
                out=$OUTDIR/${name}_r${round}_g${conc}.json
                if ! URL="http://127.0.0.1:$PORT" CONC=$conc REQUESTS=$reqs OUT=$out QUIET=1 \
                        PROMPT_TOKENS=$INPUT_LEN OUTPUT_TOKENS=$OUTPUT_LEN PIN_CLIENT="${PIN[2]:-}" \
                        bash benchmarks/guidellm_run.sh > "$OUTDIR/${name}_r${round}_g${conc}.log" 2>&1; then
                    log "$name guidellm c$conc failed (see ${out%.json}.log)"; FAILED=1
                fi
            done
        fi
        grep VmHWM "/proc/$SERVER/status" >> "$srvlog" 2>/dev/null || true
        stop_server
    done
done
.venv/bin/python benchmarks/side_by_side_table.py "$OUTDIR" --high "$C_HIGH" --low "$C_LOW" "${NAMES[@]}"
exit "$FAILED"
