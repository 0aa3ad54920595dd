"""Schemathesis against the server's own OpenAPI schema: bodies generated from the
schema, valid and invalid, on every route. The pass mark: no 5xx, ever, and the server
still serves and holds no blocks afterwards. Bounded: a few dozen examples per route."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode

from sluice.entrypoints.openai.api_server import ServerConfig
from tests.server.conftest import MODEL, RunningServer, start_engine, wait_all_blocks_free


@pytest.fixture(scope="module")
def fuzz_server(tiny_checkpoint):
    # A short context keeps every generated request quick (max_tokens past it is a 400).
    aengine, metrics, _ = start_engine(str(tiny_checkpoint("llama")), num_blocks=128, max_model_len=64)
    srv = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    yield srv
    srv.stop()
    aengine.shutdown()


OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
              "GET /version", "GET /metrics", "POST /reset_prefix_cache", "POST /tokenize", "POST /detokenize",
              "GET /tokenizer_info",
              "GET /v1/models/{model_id}"]


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def test_the_schema_lists_every_route(api_schema):
    labels = {result.ok().label for result in api_schema.get_all_operations()}
    assert set(OPERATIONS) <= labels, labels


CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE) for label in OPERATIONS
    if label.startswith("POST") and "reset" not in label]  # the others take no body


@pytest.mark.parametrize("label, mode", CASES)
def test_no_input_is_a_server_error(api_schema, fuzz_server, label, mode):
    operation = api_schema.find_operation_by_label(label)
    examples = 40 if label.startswith("POST /v1") else 15 if label.startswith("POST") else 5

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=fuzz_server.url, timeout=60)
        assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
        if response.status_code >= 400 and label.startswith("POST"):
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    check()


def test_after_the_fuzz_the_server_serves_and_holds_nothing(fuzz_server):
    r = httpx.post(f"{fuzz_server.url}/v1/completions", json={"model": MODEL, "prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200
    wait_all_blocks_free(fuzz_server.engine.engine)
