"""What a fault soak found, each as a test: hostile values, bad bodies, overload, timeouts,
disconnects, failures inside the engine. The engine is real (a tiny random Llama);
where a test needs a step to fail or to be slow, it wraps the real step with that fault."""
from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time

import httpx
import pytest

from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.serving import ServingLimits
from tests.server.conftest import (MODEL, RunningServer, StepGate, metric_value, start_engine,
                                   wait_all_blocks_free)
from tests.server.test_errors import assert_error, post

# A request that runs for 400 steps: no drafts, so one token a step, and the tests below that
# give steps a minimum time (step_delay) know it lasts at least 400 of them.
LONG = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 400, "ignore_eos": True, "speculative": False}


@contextlib.contextmanager
def serving(path: str, limits: ServingLimits | None = None, step_delay: float = 0.0, **engine_kwargs):
    """A server of its own over a fresh engine; step_delay makes every step that long at
    least (a slower model), so that requests are still running when a test acts."""
    engine_kwargs.setdefault("num_blocks", 256)
    aengine, metrics, _ = start_engine(path, **engine_kwargs)
    if step_delay:
        runner = aengine.engine.runner
        execute = runner.execute

        def slow(plan):
            time.sleep(step_delay)
            return execute(plan)
        runner.execute = slow
    srv = RunningServer(aengine, ServerConfig(served_model_name=MODEL, limits=limits or ServingLimits()), metrics)
    try:
        yield srv
    finally:
        srv.stop()
        aengine.shutdown()


def sse_events(lines) -> tuple[list[dict | str], list[str]]:
    """(data payloads, parsed JSON or '[DONE]'; comment lines) of an SSE stream."""
    data, comments = [], []
    for line in lines:
        if line.startswith(":"):
            comments.append(line)
        elif line.startswith("data: "):
            body = line[6:]
            data.append(body if body == "[DONE]" else json.loads(body))
    return data, comments


def assert_serving(url: str, llm) -> None:
    """The engine still answers, and holds no blocks once idle."""
    assert httpx.get(f"{url}/health").status_code == 200
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "still there?", "max_tokens": 3})
    assert r.status_code == 200, r.text
    wait_all_blocks_free(llm)


# -- no value can stop the engine ---------------------------------------------------
@pytest.mark.parametrize("extra, param", [
    ({"top_k": 9223372036854775808, "temperature": 1}, "top_k"),   # killed the engine loop for good
    ({"top_k": 2**40, "temperature": 1}, "top_k"),
    ({"n": 1000}, "n"),
    ({"n": 2, "best_of": 5}, "best_of"),
    ({"seed": 2**70}, "seed"),
    ({"max_tokens": 2**63}, "max_tokens"),
    ({"min_tokens": 2, "stop_token_ids": [10**12]}, "stop_token_ids"),
    ({"min_tokens": 2, "stop_token_ids": [60000]}, "stop_token_ids"),  # past the vocabulary: failed inside the step
    ({"stop": ["x"] * 100}, "stop"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
])
def test_out_of_range_values_are_400_and_the_engine_goes_on(server, extra, param):
    assert_error(post(server.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra}),
                 400, param)
    assert_serving(server.url, server.llm)


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}',
    b'{"model": "tiny-llama", "prompt": "hi", "temperature": Infinity}',
    b'{"model": "tiny-llama", "prompt": "hi", "repetition_penalty": NaN}',
    b'{"model": "tiny-llama", "prompt": "hi", "top_p": -Infinity}',
])
def test_nan_and_infinity_are_400(server, raw):
    r = post(server.url, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, fragment="finite number")


# -- every bad body is a 4xx, on a connection that stays usable -----------------------
CHAT = "/v1/chat/completions"


def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


BAD_BODIES = [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "must be a string"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "unsupported content part"),
    (CHAT, {"messages": [{"role": "user", "content": [5]}]}, None),
    (CHAT, {"messages": [{"role": "user", "content": "ab\ud800cd"}]}, "not valid Unicode"),
    (CHAT, {"messages": [{"role": 5, "content": "hi"}]}, None),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "stream_options": "yes"}, None),
    ("/v1/completions", {"prompt": "ab\ud800cd"}, "not valid Unicode"),
    ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "not valid Unicode"),
    ("/v1/completions", {"prompt": [[]]}, "empty"),
    ("/v1/completions", {"prompt": [1, "a"]}, None),
    ("/v1/completions", {"prompt": "hi", "stop": [1, 2]}, None),
    ("/v1/completions", {"prompt": "hi", "n": "many"}, None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1.5}, None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": nested(40)}}, "nests deeper"),
]


@pytest.mark.parametrize("path, body, fragment", BAD_BODIES)
def test_bad_bodies_are_400_with_openais_shape(server, path, body, fragment):
    # json.dumps keeps a lone surrogate as the \ud800 escape a hostile client would send.
    r = post(server.url, path, content=json.dumps({"model": MODEL, **body}).encode(),
             headers={"content-type": "application/json"})
    assert_error(r, 400, fragment=fragment)


@pytest.mark.parametrize("raw", [
    b'{"model": "tiny-llama", "prompt": "\xff\xfe invalid utf-8"}',
    b'[' * 100000 + b']' * 100000,
    b'"just a string"',
    b'{"prompt": ',
])
def test_unparseable_bodies_are_400(server, raw):
    r = post(server.url, "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("size", [100_000, 2_000_000])
def test_huge_headers_are_a_4xx(server, size):
    try:
        r = httpx.get(f"{server.url}/v1/models", headers={"x-junk": "a" * size}, timeout=10)
        assert 400 <= r.status_code < 500
    except httpx.TransportError:  # uvicorn answers 400 and closes while the client is still sending
        pass
    assert httpx.get(f"{server.url}/health").status_code == 200


def same_connection(url: str, requests: list[tuple[str, str, bytes]]) -> list[int]:
    """Status codes of requests sent one after another on one keep-alive connection; fails
    if the server closes it in between."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    statuses, sock = [], None
    for method, path, body in requests:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        assert (resp.getheader("connection") or "").lower() != "close", (path, resp.status)
        assert sock is None or conn.sock is sock, "the server closed the connection"
        sock = conn.sock
        statuses.append(resp.status)
    conn.close()
    return statuses


def test_connection_survives_4xx_and_500(tiny_checkpoint):
    """A 500 (an internal error, injected here) used to close the keep-alive connection
    under the client's next request on it."""
    good = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    bad = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "ab\ud800"}]}).encode()
    with serving(str(tiny_checkpoint("llama"))) as srv:
        calls = {"n": 0}
        tokenizer = srv.engine.engine.tokenizer
        encode = tokenizer.encode

        def broken_once(text, *a, **k):  # a bug, not bad input: the server must answer 500
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("injected internal error")
            return encode(text, *a, **k)
        tokenizer.encode = broken_once
        try:
            statuses = same_connection(srv.url, [("POST", "/v1/completions", good), ("POST", CHAT, bad),
                                                 ("POST", "/v1/completions", good), ("GET", "/health", b"")])
        finally:
            tokenizer.encode = encode
        assert statuses == [500, 400, 200, 200]


# -- overload is bounded, in sequences ----------------------------------------------
def test_admission_counts_sequences_and_holds_under_a_burst(tiny_checkpoint):
    """One seat, eight waiting places. The first request takes the seat, then the engine
    runs no step (StepGate) while 40 more come at once: exactly 8 are admitted (the check
    used to read the queue before the engine thread had queued the earlier ones, so all 40
    got in); one request whose prompts x n exceed the queue is a 400, not a 429."""
    with serving(str(tiny_checkpoint("llama")), ServingLimits(max_waiting=8), max_num_seqs=1) as srv:
        assert_error(post(srv.url, "/v1/completions", {**LONG, "n": 9}), 400, "n", "sequences")
        assert_error(post(srv.url, "/v1/completions", {**LONG, "prompt": ["a"] * 3, "n": 3, "max_tokens": 2}),
                     400, "n", "9 sequences")

        async def burst(gate):
            release, answered = asyncio.Event(), []
            async with httpx.AsyncClient(timeout=60) as c:
                async def one():
                    async with c.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True}) as r:
                        answered.append(r.status_code)
                        if r.status_code == 200:
                            await release.wait()  # admitted: keep its seat or waiting place
                        return r.status_code, r.headers.get("retry-after")
                seat = asyncio.create_task(one())
                await asyncio.to_thread(gate.wait_until, lambda e: e.scheduler.num_waiting == 1, "the first request")
                gate.open(steps=1)
                await asyncio.to_thread(gate.wait_until, lambda e: e.scheduler.num_running == 1, "it to run")
                tasks = [asyncio.create_task(one()) for _ in range(40)]
                while len(answered) < 41 and not any(t.done() and t.exception() for t in tasks):
                    await asyncio.sleep(0.01)
                release.set()
                return await seat, await asyncio.gather(*tasks)
        with StepGate(srv.engine) as gate:
            seat, results = asyncio.run(burst(gate))
        assert seat == (200, None)
        admitted = [r for r in results if r[0] == 200]
        assert len(admitted) == 8, results
        assert all(r == (429, "1") for r in results if r[0] != 200), results
        wait_all_blocks_free(srv.engine.engine)


def test_a_list_of_prompts_counts_each_prompt(tiny_checkpoint):
    with serving(str(tiny_checkpoint("llama")), ServingLimits(max_waiting=4), max_num_seqs=1) as srv:
        async def run(gate):
            async with httpx.AsyncClient(timeout=60) as c:
                first = c.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True, "n": 3})
                r = await first.__aenter__()
                assert r.status_code == 200
                gate.open(steps=1)  # 1 running, 2 waiting, and so they stay
                await asyncio.to_thread(gate.wait_until, lambda e: e.scheduler.num_running == 1, "a sample to run")
                many = await c.post(f"{srv.url}/v1/completions", json={**LONG, "prompt": ["a", "b", "c"]})
                await first.__aexit__(None, None, None)
                return many
        with StepGate(srv.engine) as gate:
            assert_error(asyncio.run(run(gate)), 429)
        wait_all_blocks_free(srv.engine.engine)


def test_request_timeout_ends_waiting_and_running_requests(tiny_checkpoint):
    """Both end at their deadline, long before the 400 steps (4 s at least) the running one
    needs: few steps run in all (a step count, so that no machine is too slow for it)."""
    with serving(str(tiny_checkpoint("llama")), ServingLimits(request_timeout=0.6), step_delay=0.01,
                 max_num_seqs=1) as srv:
        steps = metric_value(srv.url, "sluice_engine_steps_total")

        async def run():
            async with httpx.AsyncClient(timeout=60) as c:
                running = asyncio.create_task(c.post(f"{srv.url}/v1/completions", json=LONG))
                await asyncio.sleep(0.05)
                queued = asyncio.create_task(c.post(f"{srv.url}/v1/completions", json={**LONG, "stream": True}))
                return await running, await queued
        running, queued = asyncio.run(run())
        assert_error(running, 504, fragment="--request-timeout")
        data, _ = sse_events(queued.text.splitlines())
        assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == "timeout"
        wait_all_blocks_free(srv.engine.engine)
        assert metric_value(srv.url, "sluice_engine_steps_total") - steps < 400
        assert_serving(srv.url, srv.engine.engine)


def test_queued_stream_gets_keepalive_comments(tiny_checkpoint):
    """Both requests are queued before the first step (StepGate), so the second waits for
    the whole first one: at least 60 steps of 10 ms, far past the 0.1 s keep-alive
    interval, however fast the machine."""
    with serving(str(tiny_checkpoint("llama")), ServingLimits(sse_keepalive_s=0.1), step_delay=0.01,
                 max_num_seqs=1) as srv, StepGate(srv.engine) as gate:
        with httpx.Client(timeout=60) as c:
            first = threading.Thread(target=c.post, args=(f"{srv.url}/v1/completions",),
                                     kwargs={"json": {**LONG, "max_tokens": 60}})
            first.start()
            gate.wait_until(lambda e: e.scheduler.num_waiting == 1, "the first request")
            with c.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "max_tokens": 3, "stream": True}) as r:
                gate.wait_until(lambda e: e.scheduler.num_waiting == 2, "the second request")
                gate.open()
                data, comments = sse_events(r.iter_lines())
            first.join()
        assert comments and all(line == ": keep-alive" for line in comments)
        assert data[-1] == "[DONE]" and data[-2]["choices"][0]["finish_reason"] == "length"


# -- disconnects --------------------------------------------------------------------
def test_non_streaming_client_that_leaves_aborts_its_request(tiny_checkpoint):
    """It used to keep generating for as long as the request would have run. The client
    leaves after one step, and no step runs after it (StepGate): only the abort can end
    the request."""
    with serving(str(tiny_checkpoint("llama"))) as srv:
        llm = srv.engine.engine
        before = metric_value(srv.url, "sluice_requests_finished_total", 'finished_reason="abort"')
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({**LONG, "n": 4}).encode()
        with StepGate(srv.engine) as gate:
            with socket.create_connection((host, int(port)), timeout=30) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                gate.wait_until(lambda e: e.scheduler.num_waiting == 4, "the request")
                gate.open(steps=1)
                gate.wait_until(lambda e: e.scheduler.num_running == 4, "its samples to run")
            # The connection is closed: the server aborts the request, which frees its blocks.
            gate.wait_until(lambda e: e.kv.num_free_blocks == e.kv.num_blocks, "the abort to free the blocks")
        wait_all_blocks_free(llm)
        deadline = time.monotonic() + 30  # a hang guard: the next step reports the abort
        while metric_value(srv.url, "sluice_requests_finished_total", 'finished_reason="abort"') < before + 4:
            assert time.monotonic() < deadline, "the request was not aborted"
            time.sleep(0.05)


# -- big bodies ---------------------------------------------------------------------
def test_body_over_the_limit_is_413_before_it_is_read(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        # Announce 100 MB, send 10 bytes: the answer must come without the rest.
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000000\r\n\r\n{\"prompt\":")
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < 100:
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, body = reply.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 413"), head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_chunked_body_over_the_limit_is_413(server):
    def chunks():
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'
    r = httpx.post(f"{server.url}/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=30)
    assert_error(r, 413, fragment="--max-request-bytes")


def test_prompts_are_tokenized_off_the_event_loop_and_the_engine_thread(server):
    tokenizer = server.llm.tokenizer
    encode, threads = tokenizer.encode, []

    def recording(*a, **k):
        threads.append(threading.current_thread().name)
        return encode(*a, **k)
    tokenizer.encode = recording
    try:
        assert post(server.url, "/v1/completions", {"model": MODEL, "prompt": "a b c", "max_tokens": 2}).status_code == 200
        assert post(server.url, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                       "max_tokens": 2}).status_code == 200
    finally:
        tokenizer.encode = encode
    assert len(threads) == 2 and all(t.startswith("sluice-tokenize") for t in threads), threads


# -- failures inside the engine -----------------------------------------------------
POISON = 4242  # a token id that makes the injected fault fire


def poison_steps(aengine) -> None:
    runner = aengine.engine.runner
    execute = runner.execute

    def faulty(plan):
        if any(POISON in e.token_ids for e in plan.scheduled):
            raise RuntimeError("injected fault in the forward pass")
        return execute(plan)
    runner.execute = faulty


def test_a_failing_step_ends_its_requests_with_500_and_the_engine_goes_on(tiny_checkpoint):
    with serving(str(tiny_checkpoint("llama"))) as srv:
        poison_steps(srv.engine)
        r = post(srv.url, "/v1/completions", {"model": MODEL, "prompt": [5, POISON, 6], "max_tokens": 4})
        assert_error(r, 500, fragment="engine step running this request failed (RuntimeError)")
        assert "injected" not in r.text  # internal text stays in the log
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=30,
                          json={"model": MODEL, "prompt": [POISON], "max_tokens": 4, "stream": True}) as s:
            data, _ = sse_events(s.iter_lines())
        assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == "engine_error"
        assert_serving(srv.url, srv.engine.engine)


def test_a_dying_loop_fails_requests_in_flight_and_resets(tiny_checkpoint):
    with serving(str(tiny_checkpoint("llama")), step_delay=0.005) as srv:
        aengine = srv.engine
        with httpx.stream("POST", f"{srv.url}/v1/completions", json={**LONG, "stream": True}, timeout=30) as s:
            lines = s.iter_lines()
            next(lines)
            scheduler = aengine.engine.scheduler

            def broken():
                raise RuntimeError("injected: the scheduler's state is broken")
            scheduler.schedule = broken  # the reset builds a new scheduler without this
            data, _ = sse_events(lines)
        assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == "engine_error"
        assert "reset" in data[-2]["error"]["message"]
        steps = metric_value(srv.url, "sluice_engine_steps_total")
        assert_serving(srv.url, aengine.engine)
        # (The stream's error comes before the reset is done; a request served after it comes after.)
        assert aengine.num_resets == 1 and not aengine.dead
        assert metric_value(srv.url, "sluice_engine_steps_total") > steps  # metrics survive the reset


def test_repeated_loop_deaths_mark_the_engine_dead_and_call_on_dead(tiny_checkpoint, monkeypatch):
    from sluice.core.scheduler import Scheduler
    from sluice.engine.async_engine import MAX_RESETS
    with serving(str(tiny_checkpoint("llama"))) as srv:
        died = []
        srv.engine.on_dead = died.append

        def broken(self):
            raise RuntimeError("injected: always broken")
        monkeypatch.setattr(Scheduler, "schedule", broken)
        statuses = [post(srv.url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code
                    for _ in range(MAX_RESETS + 2)]
        # MAX_RESETS resets; the next failure (its request a 500 too) is fatal; then 503.
        assert statuses == [500] * (MAX_RESETS + 1) + [503]
        assert len(died) == 1 and srv.engine.dead
        assert_error(httpx.get(f"{srv.url}/health"), 503)
