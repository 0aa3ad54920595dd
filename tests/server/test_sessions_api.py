"""Sessions, priorities and tenants through the server: session_id and priority in the
body, DELETE /v1/sessions/{id}, tenants by API key (isolated) or by `user`, metrics."""
from __future__ import annotations

import json

import httpx
import pytest

from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.tenants import TenantSpec, load_tenants
from tests.server.conftest import MODEL, RunningServer, metric_value

HISTORY = "The agent read the file, ran the tests and looked at the failures. " * 6


@pytest.fixture(scope="module")
def tenants_url(server):
    tenants = [TenantSpec("alice", "sk-alice", 2.0), TenantSpec("bob", "sk-bob")]
    srv = RunningServer(server.engine, ServerConfig(served_model_name=MODEL, tenants=tenants), server.metrics)
    yield srv.url
    srv.stop()


@pytest.fixture(autouse=True)
def no_pins_left(server):
    """The engine is shared with the other server tests: drop every pin after each test
    (a prefix-cache reset drops pins too), so later leak checks see every block free."""
    yield
    httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
    assert server.llm.scheduler.sessions.num_pinned == 0


def call(url, session_id=None, headers=None, extra_turn="", **extra):
    body = {"model": MODEL, "prompt": HISTORY + extra_turn, "max_tokens": 4, "temperature": 0, **extra}
    if session_id is not None:
        body["session_id"] = session_id
    return httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=30)


def test_a_session_call_pins_its_blocks_and_delete_releases_them(server):
    r = call(server.url, "sess-api-1")
    assert r.status_code == 200, r.text
    assert metric_value(server.url, "sluice_session_pinned_blocks") > 0
    assert metric_value(server.url, "sluice_session_events_total", 'event="pinned"') >= 1
    nxt = call(server.url, "sess-api-1", extra_turn=r.json()["choices"][0]["text"] + " Next step.")
    assert nxt.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric_value(server.url, "sluice_session_events_total", 'event="hit"') >= 1
    d = httpx.delete(f"{server.url}/v1/sessions/sess-api-1")
    assert d.status_code == 200 and d.json()["deleted"] is True and d.json()["released_blocks"] > 0
    again = httpx.delete(f"{server.url}/v1/sessions/sess-api-1")
    assert again.status_code == 404 and again.json()["error"]["code"] == "session_not_found"


def test_sessions_are_namespaced_by_tenant(server, tenants_url):
    alice, bob = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
    assert call(tenants_url, "shared-name", headers=alice).status_code == 200
    # Bob cannot see, hit or delete Alice's session of the same name.
    assert httpx.delete(f"{tenants_url}/v1/sessions/shared-name", headers=bob).status_code == 404
    r = call(tenants_url, "shared-name", headers=bob)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.delete(f"{tenants_url}/v1/sessions/shared-name", headers=alice).json()["released_blocks"] > 0
    assert httpx.delete(f"{tenants_url}/v1/sessions/shared-name", headers=bob).status_code == 200
    # Without a key, no tenant: 401; the per-tenant metrics carry the names.
    assert call(tenants_url, "x").status_code == 401
    assert metric_value(server.url, "sluice_tenant_requests_finished_total", 'tenant="alice"') >= 1
    # Without keys the `user` field is the tenant: ?user= reaches its sessions.
    assert call(server.url, "by-user", user="carol").status_code == 200
    assert httpx.delete(f"{server.url}/v1/sessions/by-user").status_code == 404
    assert httpx.delete(f"{server.url}/v1/sessions/by-user", params={"user": "carol"}).status_code == 200


@pytest.mark.parametrize("field,value", [("session_id", "s" * 257), ("session_id", ""), ("session_id", 7),
                                         ("priority", -1), ("priority", 1.5), ("priority", "2"),
                                         ("priority", True)])
def test_bad_scheduling_fields_get_a_400_naming_the_field(server, field, value):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1, field: value}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_priority_and_chat_sessions_are_accepted(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                         extra_body={"session_id": "chat-1", "priority": 3})
    assert out.choices[0].finish_reason in ("stop", "length")


def test_tenants_file_is_checked(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"tenants": [{"name": "a", "api_key": "k1", "weight": 3}, {"name": "b"}]}))
    assert load_tenants(p) == [TenantSpec("a", "k1", 3.0), TenantSpec("b", None, 1.0)]
    for bad, match in [({"tenants": [{"name": "a"}, {"name": "a"}]}, "appears twice"),
                       ({"tenants": [{"name": "a", "weight": 0}]}, "weight"),
                       ({"tenants": [{"name": "a", "api_key": "k"}, {"name": "b", "api_key": "k"}]}, "api_key"),
                       ({"tenants": [{"nme": "a"}]}, "must be an object"),
                       ([], "tenants")]:
        p.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            load_tenants(p)
    with pytest.raises(ValueError, match="cannot read"):
        load_tenants(tmp_path / "missing.json")


def test_bench_agents_runs_programs_and_reports_per_class_and_tenant(server):
    """`sluice bench agents` end to end, small: every call succeeds, with sessions the later
    calls of a program find their history cached."""
    from sluice.bench.agents import make_programs, run_all
    from sluice.entrypoints.cli import build_parser
    args = build_parser().parse_args([
        "bench", "agents", "--url", server.url, "--model", MODEL, "--tokenizer", server.model_path,
        "--programs", "4", "--program-rate", "20", "--short-calls", "2,2", "--long-calls", "3,3",
        "--system-len", "40", "--tool-len", "10,20", "--output-len", "4", "--tool-median", "0.01",
        "--tool-max", "0.05", "--tenant", "light=1", "--tenant", "heavy=3", "--sessions", "--seed", "3"])
    programs = make_programs(args)
    assert len(programs) == 4 and {p.kind for p in programs} <= {"short", "long"}
    assert make_programs(args)[0] == programs[0]  # seeded
    import asyncio
    report = asyncio.run(run_all(args, programs))
    assert report["failed_calls"] == 0 and report["calls"] == sum(len(p.tool_results) + 1 for p in programs)
    assert report["prefix_hit_rate"] > 0.3
    assert set(report["tenants"]) == {p.tenant for p in programs}
    assert all(c["programs"] == sum(p.kind == k for p in programs) for k, c in report["classes"].items())


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome"]}}, "required": ["city"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_calls_tool_calls_reach_its_session(server, stream):
    """A session's chat call that ends in a tool call tells the engine which tool it called
    (its pin's TTL then follows that tool's gaps, core/sessions.py)."""
    sid = f"tool-session-{stream}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": HISTORY}], "max_tokens": 60,
            "temperature": 0, "session_id": sid, "tools": [WEATHER], "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": stream}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    if stream:
        assert '"finish_reason":"tool_calls"' in r.text.replace(" ", "")
    else:
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    # The note is sent to the engine thread without waiting; a request sent after it is
    # handled after it (one command queue), so once this one is answered the note is in.
    assert call(server.url).status_code == 200
    session = server.llm.scheduler.sessions.get(("", sid))
    assert session is not None and session.tools == ("get_weather",)
