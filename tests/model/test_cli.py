"""The README's promise: `sluice generate` answers a question with the default model."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


# With w4a8 and the int8 KV cache, the README's bare question is a near tie: the first
# token is "The" or "L" at ~15% each (0.06 logit apart on the refitted 4-bit scales, 0.02
# the other way on the file's own), and "L" goes on in French. The quality measures do not
# move with it (docs/benchmarks.md, Quality), so that mode is asked for one sentence.
@pytest.mark.parametrize("flags,question", [
    ([], "What is the capital of France?"),
    pytest.param(["--quantization", "w4a8", "--kv-cache-dtype", "int8"],
                 "What is the capital of France? Answer in one sentence.", marks=pytest.mark.requires("kernels"))])
def test_generate_on_default_model_answers_paris(flags, question):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "sluice.entrypoints.cli", "generate", question,
           "--max-tokens", "24", "--kv-cache-memory", "0.1", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_bad_flag_fails_fast_with_a_clear_error():
    cmd = [sys.executable, "-m", "sluice.entrypoints.cli", "generate", "hi", "--top-p", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "top_p must be in (0, 1]" in out.stderr
