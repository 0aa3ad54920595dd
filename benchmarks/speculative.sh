#!/usr/bin/env bash
# Speculative decoding served (issue 21), one sitting, through benchmarks/side_by_side.sh
# (alternating configurations round by round, each on a fresh server, `sluice bench serve`
# closed loops, medians over rounds):
#   (a) the standard workload: ~210-token windows of English text, 128 output tokens with
#       ignore_eos, c32 x 64 and c1 x 8; sluice without speculation, with ngram, with suffix;
#   (b) the repetitive workload (`--workload repetitive`: rename-in-this-function,
#       proofread-and-return, an agent re-writing its task list after each tool call),
#       answers ending where the model ends them (ignore_eos false, at most 256 tokens),
#       c32 x 64 and c1 x 9; the same sluice configurations, and llama.cpp's server (Q4_1,
#       its fastest single stream here) without and with its n-gram speculation
#       (ngram-simple with a 3-token lookup and 8-token drafts: its best of the variants
#       tried, docs/benchmarks.md).
#
#   ISA=native bash benchmarks/llamacpp_build.sh   # once (llama.cpp build and models)
#   bash benchmarks/speculative.sh                 # ROUNDS_A [3], ROUNDS_B [2], OUT [...]
set -euo pipefail
cd "$(dirname "$(realpath "$0")")/.."
OUT=${OUT:-benchmarks/results/speculative}
LC='$BIN/llama-server -m $MODELS/SmolLM2-135M-Instruct.Q4_1.gguf --host 127.0.0.1 --port $PORT -c 16384 --parallel 32 -cb -t $THREADS -kvu --no-cache-prompt'
SLUICE="default;--speculative-method ngram;--speculative-method suffix"
ROUNDS=${ROUNDS_A:-3} ISA=native LLAMACPP_TYPES="" SLUICE_CONFIGS="$SLUICE" OUTDIR=$OUT/standard \
    bash benchmarks/side_by_side.sh
ROUNDS=${ROUNDS_B:-2} ISA=native WORKLOAD=repetitive EXTRA_BODY='{"ignore_eos": false}' OUTPUT_LEN=256 R_LOW=9 \
    LLAMACPP_TYPES="" SLUICE_CONFIGS="$SLUICE" OUTDIR=$OUT/repetitive \
    EXTRA_CONFIGS="llamacpp_Q4_1|$LC
llamacpp_Q4_1_ngram-simple-3-8|$LC --spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8" \
    bash benchmarks/side_by_side.sh
