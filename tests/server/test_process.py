"""`sluice serve` as a real process (signals), and `sluice bench serve` against a server."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.server.conftest import MODEL, serve_process


@pytest.mark.parametrize("mode,ctrl_c", [(["--no-engine-process"], False), ([], False), ([], True)],
                         ids=["thread", "engine-process", "engine-process-ctrl-c"])
def test_sigterm_ends_open_streams_cleanly_and_exits_zero(tiny_checkpoint, mode, ctrl_c):
    """On SIGTERM open streams get the grace period, then a final error event and [DONE]
    (they used to be cut mid-chunk, with a CancelledError traceback each in the log). One
    sequence at a time and four samples a stream, one token a step: the streams hold
    5,760 steps of work, which no machine finishes in the 0.3 s grace. ctrl_c: SIGINT to
    the whole process group instead, as a terminal sends it: the engine core too, which
    used to die under the server with a KeyboardInterrupt and leave it blocked for good
    sending Stop to nobody. Either way nothing of the server is left running."""
    import psutil
    proc, url = serve_process("--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "128",
                              "--served-model-name", MODEL, "--shutdown-grace", "0.3", "--max-num-seqs", "1", *mode,
                              new_session=ctrl_c)
    children = psutil.Process(proc.pid).children(recursive=True)
    try:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 4,
                "speculative": False}
        with httpx.Client(timeout=30) as c:
            streams = [c.stream("POST", f"{url}/v1/completions", json=body) for _ in range(3)]
            lines = [s.__enter__().iter_lines() for s in streams]  # each in the engine once its headers come
            next(lines[0])
            if ctrl_c:
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            tails = [[line for line in it if line.startswith("data: ")][-2:] for it in lines]
            for s in streams:
                s.__exit__(None, None, None)
            rc = proc.wait(timeout=30)
        assert rc == 0
        for last, done in tails:
            assert done == "data: [DONE]"
            assert json.loads(last[6:]).get("error", {}).get("code") == "shutting_down", last
        log = proc.stdout.read()
        assert "Traceback" not in log and "CancelledError" not in log, log[-3000:]
        assert not psutil.wait_procs(children, timeout=30)[1]  # a hang guard: they are gone already
    finally:
        if proc.poll() is None:
            proc.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def test_bench_serve_reports_json_and_plot(server, tmp_path, capsys):
    """`sluice bench serve`: the CLI's own main, in this process (the server runs in a
    thread of it too)."""
    from sluice.entrypoints.cli import main
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "serve", "--url", server.url, "--model", MODEL, "--tokenizer", server.model_path,
            "--concurrency", "1,4", "--requests", "8", "--input-len", "32", "--output-len", "8"]
    assert main(argv + ["--json", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [r["concurrency"] for r in runs] == [1, 4]
    for r in runs:
        assert r["failed"] == 0 and r["requests"] == 8
        assert r["output_tok_per_s"] > 0 and r["ttft_p50_s"] > 0 and r["tpot_p50_s"] > 0
    assert png.stat().st_size > 1000
    capsys.readouterr()
    assert main(argv + ["--request-rate", "20"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["request_rate"] == 20.0
