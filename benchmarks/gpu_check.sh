#!/usr/bin/env bash
# The GPU check: one prepared command for a machine with an NVIDIA GPU (the device tool's
# H200 when a task is lent one). It installs what the machine lacks from wheels carried in
# .whl/ (fastapi, uvicorn, pydantic, llguidance, gguf, ...: see the device tool's README for
# how to download them here), then runs benchmarks/gpu_check.py: the CUDA tests on the GPU,
# the SmolLM2-shaped model served at c1/c32/c128, a Llama-3.1-8B-shaped model with random
# bf16 weights offline (asynchronous scheduling on, and off at c1/c32) and served at
# c1/c32/c128 (512-token prompts, 256 outputs), and HF
# transformers' continuous batching on the same shape; one table, ~8 minutes.
#   bash benchmarks/gpu_check.sh            # TOKENIZER defaults to .gpu/tokenizer
# Results: $OUT (or benchmarks/results/gpu_check)/report.json and the printed table.
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 benchmarks/gpu_check.py --tokenizer-dir "${TOKENIZER:-.gpu/tokenizer}" --out "${OUT:-benchmarks/results/gpu_check}" "$@"
