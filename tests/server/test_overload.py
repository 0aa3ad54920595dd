"""Admission that tells the truth under overload: a bad request is a 400 however full the
server is, and a request that cannot start within --max-queue-wait is answered 429 with a
Retry-After rather than held. The engine's steps are held by a StepGate, so which request
is waiting is decided by the test, not by the machine's speed."""
from __future__ import annotations

import threading

import httpx
import pytest

from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.serving import ServingLimits
from tests.server.conftest import MODEL, RunningServer, StepGate, start_engine, wait_all_blocks_free


@pytest.fixture(scope="module")
def full(tiny_checkpoint):
    aengine, metrics, _ = start_engine(str(tiny_checkpoint("llama")), num_blocks=256, max_num_seqs=1)
    server = RunningServer(aengine, ServerConfig(served_model_name=MODEL, limits=ServingLimits(
        max_waiting=1, max_queue_wait=0.3)), metrics)
    yield server, aengine
    server.stop()
    aengine.shutdown()


def post(server, **body):
    return httpx.post(f"{server.url}/v1/completions", timeout=60,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, **body})


def test_a_bad_request_is_400_on_a_full_server(full):
    server, aengine = full
    with StepGate(aengine) as gate:
        held = {}
        t = threading.Thread(target=lambda: held.update(r=post(server, max_tokens=4)))
        t.start()
        # Queued (or, on a machine slower than the bound, already dropped from the queue):
        # either way a good request now is refused, as the queue is full or it waits past it.
        gate.wait_until(lambda e: e.scheduler.num_waiting == 1 or "r" in held, "the queue to be full")
        assert post(server).status_code == 429
        for bad, what in (({"prompt": [10**7]}, "token ids"), ({"prompt": ""}, "empty"),
                          ({"max_tokens": 10**6}, "max_model_len"), ({"prompt": "x " * 600}, "max_model_len")):
            r = post(server, **bad)
            assert r.status_code == 400, (bad, r.text)
            assert what in r.json()["error"]["message"], (bad, r.text)
        t.join(60)  # queued past its 0.3 s bound while the steps are held: dropped
    r = held["r"]
    assert r.status_code == 429 and r.json()["error"]["code"] == "queue_timeout"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    wait_all_blocks_free(aengine.engine)


def test_a_stream_past_its_queue_wait_ends_with_an_error_event(full):
    server, aengine = full
    with StepGate(aengine):
        with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "Hello", "max_tokens": 2, "stream": True}) as s:
            events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"queue_timeout"' in events[-2]
    wait_all_blocks_free(aengine.engine)
