"""Tenants' rate limits (entrypoints/openai/quotas.py) over HTTP: requests and tokens per
minute, max_tokens and concurrency caps, answered as OpenAI answers them (429 with
Retry-After and x-ratelimit-* headers; 400 for what could never fit). The limiter's clock
is frozen by the test, so what refills is decided by the test, never by the machine's
speed."""
from __future__ import annotations

import threading

import httpx
import pytest

from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.tenants import TenantSpec
from tests.server.conftest import MODEL, RunningServer, StepGate, metric_value, start_engine, wait_all_blocks_free

TENANTS = [TenantSpec("alice", "sk-alice", rpm=2), TenantSpec("carol", "sk-carol", tpm=100),
           TenantSpec("bob", "sk-bob", max_tokens=8, max_concurrency=1), TenantSpec("free", "sk-free")]


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module")
def limited(tiny_checkpoint):
    aengine, metrics, _ = start_engine(str(tiny_checkpoint("llama")), num_blocks=256)
    server = RunningServer(aengine, ServerConfig(served_model_name=MODEL, tenants=TENANTS), metrics)
    quotas = server.server.config.app.state.quotas
    clock = Clock()
    quotas.clock = clock
    for st in quotas._tenants.values():  # the buckets were filled at the real clock's time
        for b in (st.requests, st.tokens):
            if b is not None:
                b.t = clock.t
    yield server, aengine, clock
    server.stop()
    aengine.shutdown()


def post(server, key: str, **body):
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                      json={"model": MODEL, "prompt": "Hello there", "max_tokens": 2, "temperature": 0, **body})


def test_requests_per_minute(limited):
    server, aengine, clock = limited
    first, second = post(server, "sk-alice"), post(server, "sk-alice")
    assert first.status_code == second.status_code == 200
    assert first.headers["x-ratelimit-limit-requests"] == "2"
    assert (first.headers["x-ratelimit-remaining-requests"], second.headers["x-ratelimit-remaining-requests"]) == \
        ("1", "0")
    third = post(server, "sk-alice")
    assert third.status_code == 429
    assert third.json()["error"]["code"] == "rate_limit_exceeded" and "RPM" in third.json()["error"]["message"]
    assert third.headers["retry-after"] == "30" and third.headers["x-ratelimit-reset-requests"] == "1m0s"
    from openai import OpenAI, RateLimitError
    c = OpenAI(base_url=f"{server.url}/v1", api_key="sk-alice", max_retries=0)
    with pytest.raises(RateLimitError):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert post(server, "sk-free").status_code == 200  # other tenants are not held back
    clock.t += 30  # one request's worth refilled
    assert post(server, "sk-alice").status_code == 200
    assert post(server, "sk-alice").status_code == 429
    assert metric_value(server.url, "sluice_tenant_rate_limited", 'limit="requests"') == 3
    wait_all_blocks_free(aengine.engine)


def test_tokens_per_minute(limited):
    server, aengine, clock = limited
    never = post(server, "sk-carol", max_tokens=200)
    assert never.status_code == 400 and "tokens per minute" in never.json()["error"]["message"]
    ok = post(server, "sk-carol", max_tokens=50, ignore_eos=True)
    assert ok.status_code == 200
    used = ok.json()["usage"]["total_tokens"]
    # Its prompt is taken at admission and its 50 output tokens as it ends (before this answer):
    # what is left cannot hold another such request.
    assert int(ok.headers["x-ratelimit-remaining-tokens"]) == 100 - used
    again = post(server, "sk-carol", max_tokens=50)
    assert again.status_code == 429 and "TPM" in again.json()["error"]["message"]
    left = 100 - used
    need = ok.json()["usage"]["prompt_tokens"] + 50
    assert int(again.headers["retry-after"]) == -(-(need - left) * 60 // 100)
    clock.t += 60
    assert post(server, "sk-carol", max_tokens=50).status_code == 200
    wait_all_blocks_free(aengine.engine)


def test_max_tokens_and_concurrency(limited):
    server, aengine, _ = limited
    assert post(server, "sk-bob", max_tokens=20).status_code == 400
    capped = post(server, "sk-bob", max_tokens=None, ignore_eos=True)
    assert capped.status_code == 200 and capped.json()["usage"]["completion_tokens"] == 8
    # A request the engine refuses (token ids past the vocabulary) costs nothing and frees its slot.
    assert post(server, "sk-bob", prompt=[10**7]).status_code == 400
    with StepGate(aengine) as gate:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=post(server, "sk-bob", max_tokens=4)))
        t.start()
        gate.wait_until(lambda e: e.scheduler.num_waiting == 1, "the first request to be queued")
        second = post(server, "sk-bob", max_tokens=4)
        assert second.status_code == 429 and "max_concurrency 1" in second.json()["error"]["message"]
        assert second.headers["retry-after"] == "1"
        gate.open()
        t.join(60)
    assert result["r"].status_code == 200
    assert post(server, "sk-bob", max_tokens=4).status_code == 200
    assert metric_value(server.url, "sluice_tenant_rate_limited", 'limit="concurrency"') == 1
    wait_all_blocks_free(aengine.engine)


def test_tenants_file_limits(tmp_path):
    import json

    from sluice.entrypoints.openai.tenants import load_tenants
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"tenants": [{"name": "a", "api_key": "k", "rpm": 5, "tpm": 1000, "max_tokens": 64,
                                          "max_concurrency": 2}]}))
    (a,) = load_tenants(f)
    assert (a.rpm, a.tpm, a.max_tokens, a.max_concurrency) == (5, 1000, 64, 2)
    f.write_text(json.dumps({"tenants": [{"name": "a", "rpm": 0}]}))
    with pytest.raises(ValueError, match=r"rpm must be an integer >= 1"):
        load_tenants(f)
