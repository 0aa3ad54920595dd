"""The README's promise: `sluice generate` answers a question with the default model."""
from __future__ import annotations

import os
import subprocess
import sys


# (w4a8 with the int8 KV cache, the fast mode's flags: test_engine.py's
# test_w4a8_with_the_int8_kv_cache_answers_paris, in process.)
def test_generate_on_default_model_answers_paris():
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "sluice.entrypoints.cli", "generate", "What is the capital of France?",
           "--max-tokens", "24", "--kv-cache-memory", "0.1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_bad_flag_fails_fast_with_a_clear_error(capsys, monkeypatch):
    """The CLI's own main, in this process: the flag is refused before a model loads."""
    from sluice.entrypoints import cli, llm

    def loading(*args, **kwargs):
        raise AssertionError("a model started loading before the flag was refused")
    monkeypatch.setattr(llm.LLM, "__init__", loading)
    assert cli.main(["generate", "hi", "--top-p", "2"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
