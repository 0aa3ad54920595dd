"""`sluice serve --engine-process`: the engine core in a process of its own, behind the
same HTTP API. Real processes throughout (the server's CLI, which spawns the core), on
the tiny random Llama in float32, compared with the in-process server on the same
checkpoint."""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import httpx
import psutil
import pytest

from tests.server.conftest import MODEL, serve_process


@pytest.fixture(scope="module")
def eserver(tiny_checkpoint):
    proc, url = serve_process("--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "512",
                              "--served-model-name", MODEL, "--engine-process")
    yield url
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not psutil.pid_exists(proc.pid)


def same_shape(answer: dict) -> dict:
    """An answer without what differs between two servers for the same request: its id,
    its time, and how much of its prompt each server's prefix cache already held."""
    answer.pop("id", None), answer.pop("created", None)
    if isinstance(answer.get("usage"), dict):
        answer["usage"].pop("prompt_tokens_details", None)
    return answer


def core_of(proc: subprocess.Popen) -> psutil.Process:
    """The server's engine-core child (the one that is not multiprocessing's resource tracker)."""
    kids = [p for p in psutil.Process(proc.pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(kids) == 1, [p.cmdline() for p in kids]
    return kids[0]


def dashboard_now(url: str) -> dict:
    """One snapshot of the engine, made by the core when asked (not at a step's end)."""
    with httpx.stream("GET", f"{url}/dashboard/events", timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                return json.loads(line[6:])
    raise AssertionError("no dashboard event")


BODIES = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": [5, 6, 7, 8], "max_tokens": 9, "temperature": 1.0, "seed": 7, "n": 2,
                         "ignore_eos": True, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi there"}], "max_tokens": 10,
                              "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "echo this back", "max_tokens": 6, "temperature": 0, "echo": True,
                         "logprobs": 1, "prompt_logprobs": 2, "return_token_ids": True, "ignore_eos": True}),
    ("/v1/completions", {"prompt": "stop early", "max_tokens": 30, "temperature": 1.0, "seed": 11,
                         "stop": ["e", "a"], "n": 3}),
]


@pytest.mark.parametrize("path,body", BODIES)
def test_answers_match_the_in_process_server(eserver, server, path, body):
    """The same request gives the same tokens, logprobs and usage in both modes (a seeded
    sampled one too: its parameters cross the process boundary intact)."""
    body = {"model": MODEL, **body}
    a = httpx.post(f"{eserver}{path}", json=body, timeout=60)
    b = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert a.status_code == b.status_code == 200, a.text
    assert same_shape(a.json()) == same_shape(b.json())


@pytest.mark.parametrize("path,body", BODIES)
def test_streams_match_the_in_process_server(eserver, server, path, body):
    """Streamed, chunk by chunk: the outputs cross the boundary as deltas and are put
    back together into what the engine made."""
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}

    def chunks(url: str) -> list[dict]:
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        out = []
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(same_shape(json.loads(line[6:])))
        return out

    a, b = chunks(eserver), chunks(server.url)
    assert a == b


def test_streams_and_a_client_that_leaves_frees_its_blocks(eserver):
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{eserver}/v1/completions", json=body) as r:
            assert r.status_code == 200
            got = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    got.append(json.loads(line[6:]))
                if len(got) == 3:
                    break  # leave mid-generation
        assert all(g["choices"][0]["finish_reason"] is None for g in got)
        # The abort crosses to the core, which frees the request's blocks (a hang guard,
        # not a timing: the snapshot is the core's state when it answers).
        for _ in range(600):
            snap = dashboard_now(eserver)
            if snap["running"] == 0 and snap["waiting"] == 0 and snap["kv"]["used"] == 0:
                break
        else:
            raise AssertionError(f"the request still holds the engine: {snap}")
        full = c.post(f"{eserver}/v1/completions", json={**body, "max_tokens": 5})
        events = [line for line in full.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,status,fragment", [
    ({"prompt": "x " * 600, "max_tokens": 4}, 400, "max_model_len"),
    ({"prompt": "x", "max_tokens": 4, "logit_bias": {"99999": 1.0}}, 400, "logit_bias"),
    ({"prompt": "x", "max_tokens": 4, "model": "nope"}, 404, "does not exist"),
    ({"prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "(["}}, 400, "structured_outputs"),
])
def test_bad_requests_get_their_4xx_in_the_servers_process(eserver, body, status, fragment):
    r = httpx.post(f"{eserver}/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert httpx.post(f"{eserver}/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2},
                      timeout=60).status_code == 200


def test_a_grammar_is_followed_across_the_boundary(eserver):
    r = httpx.post(f"{eserver}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "code:", "max_tokens": 20, "temperature": 1.0, "seed": 3,
        "structured_outputs": {"regex": "[0-9]{2}-[a-c]{3}"}})
    assert r.status_code == 200, r.text
    assert re.fullmatch("[0-9]{2}-[a-c]{3}", r.json()["choices"][0]["text"])


def test_metrics_sessions_and_cache_reset_are_the_cores(eserver):
    httpx.post(f"{eserver}/v1/completions", json={"model": MODEL, "prompt": "count me", "max_tokens": 3}, timeout=60)
    text = httpx.get(f"{eserver}/metrics", timeout=30).text
    steps = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("sluice_engine_steps_total")]
    assert steps and steps[0] > 0
    assert 'sluice_requests_finished_total{finished_reason="length"' in text
    r = httpx.delete(f"{eserver}/v1/sessions/nobody", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = httpx.post(f"{eserver}/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and isinstance(r.json()["reset_blocks"], int)
    assert httpx.get(f"{eserver}/v1/models", timeout=30).json()["data"][0]["id"] == MODEL


def test_a_killed_core_ends_open_streams_and_the_server_exits_non_zero(tiny_checkpoint):
    proc, url = serve_process("--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "128",
                              "--served-model-name", MODEL, "--engine-process", "--max-num-seqs", "1")
    try:
        body = {"model": MODEL, "prompt": "go", "max_tokens": 480, "ignore_eos": True, "stream": True, "n": 4}
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                core_of(proc).kill()
                tail = [line for line in lines if line.startswith("data: ")][-2:]
        assert tail[-1] == "data: [DONE]"
        assert json.loads(tail[0][6:])["error"]["code"] == "engine_unavailable", tail
        try:
            rc = proc.wait(timeout=60)  # a hang guard
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError("the server did not exit: " + proc.stdout.read()[-3000:]) from None
        log = proc.stdout.read()
        assert rc == 1, log[-3000:]
        assert "the engine-core process exited unexpectedly" in log
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("flag", ["--enable-weight-updates", "--enable-lora-updates"])
def test_flags_that_need_one_process_are_refused_in_one_line(flag, capsys, monkeypatch):
    """The CLI's own main, in this process (the refusal comes before anything loads: were it
    to come later, the stand-in serve below fails the test instead of loading a model)."""
    from sluice.entrypoints import cli
    from sluice.entrypoints.openai import api_server

    def serve(*args, **kwargs):
        raise AssertionError("the flags were not refused before the server started")
    monkeypatch.setattr(api_server, "serve", serve)
    assert cli.main(["serve", "--engine-process", flag]) == 2
    err = capsys.readouterr().err
    assert f"--engine-process does not take {flag}" in err and err.count("\n") == 1, err


def test_a_model_that_fails_to_load_is_reported_and_nothing_is_left_running(tmp_path):
    out = subprocess.run([sys.executable, "-m", "sluice.entrypoints.cli", "serve", "--engine-process", "--model",
                          str(tmp_path / "missing")], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "missing" in out.stderr
