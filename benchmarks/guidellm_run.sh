#!/usr/bin/env bash
# One guidellm (0.8.1) closed-loop run against an OpenAI-compatible server (sluice, vLLM,
# llama-server, ...): CONC concurrent streams, REQUESTS requests in all, synthetic prompts
# of 210 tokens (sized by SmolLM2's tokenizer from a local HF folder, never the hub) and
# 128 output tokens each (guidellm sends max_tokens=128, ignore_eos=true, stop=null),
# streaming /v1/completions, model name smollm2-135m. guidellm's JSON report goes to OUT;
# its console tables go to stdout. Summarise reports with benchmarks/guidellm_summary.py.
#
#   URL=http://127.0.0.1:8198 CONC=32 REQUESTS=64 OUT=/tmp/g_c32.json bash benchmarks/guidellm_run.sh
#   URL=http://127.0.0.1:8199 CONC=1 REQUESTS=8 OUT=/tmp/g_c1.json PIN_CLIENT=1 bash benchmarks/guidellm_run.sh
#
# Needs a guidellm venv (python3 -m venv /tmp/scratch/guidellm &&
# /tmp/scratch/guidellm/bin/pip install guidellm==0.8.1) and the HF folder of the model
# (/tmp/scratch/models/SmolLM2-135M-Instruct-bf16, made from the GGUF by transformers).
# The server must already be up (guidellm checks GET /health first).
#
# Environment (defaults in brackets):
#   URL        server base URL, without /v1 (required)
#   CONC       concurrent streams (required)
#   REQUESTS   requests in all, the run stops after them (required)
#   OUT        path of the JSON report (required; its folder is created)
#   PIN_CLIENT taskset CPU list for the client, e.g. 1 [unset: not pinned]
#   PROMPT_TOKENS [210]  OUTPUT_TOKENS [128]  MODEL [smollm2-135m]  SEED [42]
#   TOKENIZER  [/tmp/scratch/models/SmolLM2-135M-Instruct-bf16]
#   GUIDELLM_VENV [/tmp/scratch/guidellm]
#   QUIET      [0; 1: no console tables, only the JSON]
# No warm-up or cool-down phase is excluded: every request counts. Run a few requests
# first (e.g. CONC=1 REQUESTS=2 to a throw-away OUT) to warm a server up.
set -euo pipefail

: "${URL:?set URL, e.g. http://127.0.0.1:8198}"
: "${CONC:?set CONC (concurrent streams)}"
: "${REQUESTS:?set REQUESTS (requests in all)}"
: "${OUT:?set OUT (path of the JSON report)}"
PROMPT_TOKENS=${PROMPT_TOKENS:-210}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-128}
MODEL=${MODEL:-smollm2-135m}
SEED=${SEED:-42}
TOKENIZER=${TOKENIZER:-/tmp/scratch/models/SmolLM2-135M-Instruct-bf16}
GUIDELLM_VENV=${GUIDELLM_VENV:-/tmp/scratch/guidellm}
QUIET=${QUIET:-0}

GUIDELLM="$GUIDELLM_VENV/bin/guidellm"
[ -x "$GUIDELLM" ] || { echo "no guidellm at $GUIDELLM (GUIDELLM_VENV)" >&2; exit 2; }
[ -f "$TOKENIZER/tokenizer.json" ] || { echo "no tokenizer.json in $TOKENIZER (TOKENIZER)" >&2; exit 2; }

# Never reach the Hugging Face hub: the tokenizer is a local folder.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

mkdir -p "$(dirname "$OUT")"
rm -f "$OUT"

PIN=()
if [ -n "${PIN_CLIENT:-}" ]; then
    PIN=(taskset -c "$PIN_CLIENT")
fi

CONSOLE=(--output kind=console --disable-console-interactive)
if [ "$QUIET" = 1 ]; then
    CONSOLE=(--disable-console)
fi

"${PIN[@]}" "$GUIDELLM" run \
    --backend "kind=openai_http,target=$URL,model=$MODEL,request_format=/v1/completions,stream=true" \
    --profile "kind=concurrent,streams=$CONC" \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --tokenizer "kind=huggingface_auto,model=$TOKENIZER" \
    --seed "kind=static,value=$SEED" \
    --output "kind=json,path=$OUT" \
    "${CONSOLE[@]}"

[ -s "$OUT" ] || { echo "guidellm wrote no report at $OUT" >&2; exit 1; }
echo "guidellm report: $OUT"
