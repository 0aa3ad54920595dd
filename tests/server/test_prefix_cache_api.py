"""Prefix caching through the server: cached_tokens in usage, salts, reset, metrics."""
from __future__ import annotations

import httpx

from tests.server.conftest import MODEL, metric_value

SYSTEM = "You are a meticulous assistant. " * 12


def chat(url, content, headers=None, **extra):
    body = {"model": MODEL, "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
            "max_tokens": 3, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_repeated_system_prompt_is_served_from_cache(server):
    httpx.post(f"{server.url}/reset_prefix_cache")
    first = chat(server.url, "first question")
    second = chat(server.url, "second question")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64 and cached % 16 == 0 and cached < second["prompt_tokens"]
    assert metric_value(server.url, "sluice_prefix_cache_hits_total") >= cached
    assert metric_value(server.url, "sluice_prefix_cache_hit_rate") > 0


def test_cache_salt_and_api_keys_isolate_tenants(server):
    httpx.post(f"{server.url}/reset_prefix_cache")
    chat(server.url, "salted", cache_salt="team-a")
    assert chat(server.url, "salted", cache_salt="team-b")["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat(server.url, "salted", cache_salt="team-a")["prompt_tokens_details"]["cached_tokens"] > 0
    # The keyed server gives its key's tenant its own namespace: the unsalted cache above is not visible.
    chat(server.url, "keyed")
    key = {"Authorization": "Bearer sekret"}
    assert chat(server.keyed_url, "keyed", headers=key)["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat(server.keyed_url, "keyed", headers=key)["prompt_tokens_details"]["cached_tokens"] > 0


def test_reset_route(server):
    chat(server.url, "to be forgotten")
    r = httpx.post(f"{server.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["reset_blocks"] > 0
    assert chat(server.url, "to be forgotten")["prompt_tokens_details"]["cached_tokens"] == 0
    assert httpx.post(f"{server.keyed_url}/reset_prefix_cache").status_code == 401
