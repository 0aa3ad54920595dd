"""Every error is OpenAI-shaped with the right status, and leaves the engine unharmed."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.server.conftest import (MODEL, RunningServer, StepGate, metric_value, start_engine,
                                   wait_all_blocks_free)


def post(url, path, body=None, content=None, headers=None):
    return httpx.post(f"{url}{path}", json=body, content=content, headers=headers or {}, timeout=30)


def assert_error(r, status, param=None, fragment=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    if fragment is not None:
        assert fragment in err["message"], err


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "top_k": 0}, "top_k"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": "lots"}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
])
def test_invalid_parameters_are_400(server, body, param):
    assert_error(post(server.url, "/v1/completions", {"model": MODEL, **body}), 400, param)


def test_too_long_prompt_says_limit_and_length(server):
    limit = server.llm.max_model_len
    r = post(server.url, "/v1/completions", {"model": MODEL, "prompt": [5] * (limit + 10)})
    assert_error(r, 400, fragment=f"max_model_len is {limit}")
    assert str(limit + 10) in r.json()["error"]["message"]
    r = post(server.url, "/v1/completions", {"model": MODEL, "prompt": [5] * 100, "max_tokens": limit})
    assert_error(r, 400, fragment=f"exceeds max_model_len {limit} by 100")


def test_malformed_json_and_bad_messages(server):
    assert_error(post(server.url, "/v1/completions", content=b'{"prompt": "hi",',
                      headers={"content-type": "application/json"}), 400, fragment="malformed JSON")
    assert_error(post(server.url, "/v1/chat/completions", {"model": MODEL, "messages": "hello"}), 400, "messages")
    assert_error(post(server.url, "/v1/chat/completions", {"model": MODEL, "messages": []}), 400, "messages")


def test_auth_401(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    assert_error(post(server.keyed_url, "/v1/completions", body), 401)
    assert_error(post(server.keyed_url, "/v1/completions", body, headers={"Authorization": "Bearer nope"}), 401)
    ok = post(server.keyed_url, "/v1/completions", body, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200


def test_unknown_model_and_route_404(server):
    assert_error(post(server.url, "/v1/completions", {"model": "gpt-9", "prompt": "hi"}), 404, "model")
    assert_error(httpx.get(f"{server.url}/v2/nothing"), 404)


def test_overload_is_429_with_retry_after(server):
    """One seat, two waiting places: the fourth concurrent request is turned away. The
    engine runs one step, to seat the first, then none until the end (StepGate): the seat
    stays taken however fast this machine would have generated its 400 tokens."""
    aengine, metrics, _ = start_engine(server.model_path, num_blocks=256, max_num_seqs=1)
    from sluice.entrypoints.openai.api_server import ServerConfig
    from sluice.entrypoints.openai.serving import ServingLimits
    srv = RunningServer(aengine, ServerConfig(served_model_name=MODEL, limits=ServingLimits(max_waiting=2)), metrics)
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 400, "ignore_eos": True, "stream": True}

        async def run(gate):
            async with httpx.AsyncClient(timeout=60) as c:
                streams = []
                for i in range(3):
                    s = c.stream("POST", f"{srv.url}/v1/completions", json=body)
                    r = await s.__aenter__()
                    assert r.status_code == 200
                    streams.append(s)
                    if i == 0:  # seat it
                        gate.open(steps=1)
                        await asyncio.to_thread(gate.wait_until, lambda e: e.scheduler.num_running == 1,
                                                "the first request to run")
                rejected = await c.post(f"{srv.url}/v1/completions", json=body)
                assert aengine.engine.scheduler.num_running == 1
                for s in streams:
                    await s.__aexit__(None, None, None)
                return rejected
        with StepGate(aengine) as gate:
            rejected = asyncio.run(run(gate))
        assert_error(rejected, 429)
        assert rejected.headers["retry-after"] == "1"
        wait_all_blocks_free(aengine.engine)
    finally:
        srv.stop()
        aengine.shutdown()


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    """Once the request has streamed a few tokens the engine stops stepping (StepGate), so
    the request is still running when the client leaves, however fast this machine is."""
    before = metric_value(server.url, "sluice_requests_finished_total", 'finished_reason="abort"')
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    llm = server.llm
    with StepGate(server.engine, shut=False) as gate:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
                gate.shut()
                assert llm.kv.num_free_blocks < llm.kv.num_blocks
            # Leaving the block closes the connection mid-stream: the abort frees the blocks
            # at once (no step needed).
        gate.wait_until(lambda e: e.kv.num_free_blocks == e.kv.num_blocks, "the abort to free the blocks")
    wait_all_blocks_free(llm)
    deadline = time.time() + 30  # a hang guard: the next step reports the abort
    while metric_value(server.url, "sluice_requests_finished_total", 'finished_reason="abort"') <= before:
        assert time.time() < deadline, "disconnect did not abort the request"
        time.sleep(0.05)


def test_bad_requests_do_not_disturb_others(client, server):
    good = client.completions.create(model=MODEL, prompt="steady", max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    for _ in range(5):
        post(server.url, "/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 9})
    again = client.completions.create(model=MODEL, prompt="steady", max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
    assert again == good
    wait_all_blocks_free(server.llm)


def test_one_bad_prompt_in_a_list_rejects_all_and_leaks_nothing(server):
    limit = server.llm.max_model_len
    r = post(server.url, "/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7], [5] * (limit + 1)],
                                             "max_tokens": 50, "ignore_eos": True})
    assert_error(r, 400, fragment="max_model_len")
    wait_all_blocks_free(server.llm)
