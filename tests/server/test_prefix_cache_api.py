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


def test_offloaded_prefixes_come_back_through_the_server(tiny_checkpoint, tmp_path):
    """--kv-offload-memory and --kv-offload-dir as the CLI gives them: a prompt pushed out of a
    small cache by other traffic is served from the tiers (cached_tokens), and /metrics
    shows each tier."""
    from sluice.entrypoints.cli import build_parser, engine_kwargs
    from tests.server.conftest import RunningServer, ServerConfig, start_engine
    path = str(tiny_checkpoint("llama"))
    args = build_parser().parse_args(["serve", "--model", path, "--kv-offload-memory", "0.0005",
                                      "--kv-offload-dir", str(tmp_path), "--kv-offload-disk-size", "0.01",
                                      "--kv-offload-dtype", "exact"])
    kwargs = {k: v for k, v in engine_kwargs(args).items() if k.startswith("kv_offload")}
    assert kwargs == dict(kv_offload_memory=0.0005, kv_offload_dir=str(tmp_path), kv_offload_disk_size=0.01,
                          kv_offload_dtype="exact")
    aengine, metrics, _ = start_engine(path, num_blocks=24, **kwargs)
    aengine.engine.kv.offload.use_costs = False  # (the reloads counted below are not the clock's call)
    srv = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    def complete(prompt: str) -> dict:
        r = httpx.post(f"{srv.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                                          "temperature": 0}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    try:
        first = complete(SYSTEM + "the question")
        for i in range(6):  # other prompts cycle every block of the cache
            complete(f"other traffic number {i} " * 20)
        again = complete(SYSTEM + "the question")
        assert again["prompt_tokens_details"]["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16
        index = aengine.engine.kv.offload
        hits = index.host.stats.hits + index.disk.stats.hits
        assert hits > 0 and index.disk is not None
        moved = sum(metric_value(srv.url, "sluice_kv_offload_blocks_moved_total", f'event="hit",model_name="{MODEL}",'
                                 f'tier="{tier}"') for tier in ("host", "disk"))
        assert moved == hits
        assert metric_value(srv.url, "sluice_kv_offload_blocks", 'tier="disk"') == index.num_blocks("disk")
        assert metric_value(srv.url, "sluice_kv_offload_reload_seconds_total") > 0
    finally:
        srv.stop()
        aengine.shutdown()
