"""LoRA adapters over HTTP: picked by `model` through the openai client, listed by
/v1/models, loaded and unloaded at run time by vLLM's routes, and their errors."""
from __future__ import annotations

import httpx
import pytest

from sluice.entrypoints.openai.api_server import ServerConfig
from tests.server.conftest import MODEL, RunningServer, metric_value, start_engine, wait_all_blocks_free

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def lora_server(tiny_checkpoint, tmp_path_factory):
    from tests.model.test_lora import ADAPTERS, make_adapter
    base = tiny_checkpoint("llama")
    root = tmp_path_factory.mktemp("lora-api")
    folders = {}
    for seed, name in enumerate(("all", "rs")):
        make_adapter(base, root / name, seed, **ADAPTERS[name])
        folders[name] = str(root / name)
    aengine, metrics, _ = start_engine(str(base), num_blocks=256, lora_modules={"sql": folders["all"]}, max_loras=2)
    open_ = RunningServer(aengine, ServerConfig(served_model_name=MODEL, enable_lora_updates=True), metrics)
    off = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    keyed = RunningServer(aengine, ServerConfig(served_model_name=MODEL, api_key="sekret", enable_lora_updates=True),
                          metrics)
    yield open_, off, keyed, aengine, folders, base
    for s in (open_, off, keyed):
        s.stop()
    aengine.shutdown()


def client(url: str):
    from openai import OpenAI
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_adapter_served_by_model_name(lora_server):
    server, _, _, aengine, folders, _ = lora_server
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == folders["all"]
    assert cards[MODEL]["parent"] is None
    assert httpx.get(f"{server.url}/v1/models/sql").json()["parent"] == MODEL
    c = client(server.url)
    prompt = "The history of the Roman Empire begins with"
    base = c.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    sql = c.completions.create(model="sql", prompt=prompt, max_tokens=12, temperature=0)
    assert sql.model == "sql" and base.model == MODEL
    assert sql.choices[0].text != base.choices[0].text
    # The tokens of transformers on PEFT's merged model.
    from tests.model.test_lora import merged_reference
    from tests.model.test_vs_transformers import hf_greedy
    tok = aengine.engine.tokenizer
    ref, _ = hf_greedy(merged_reference(str(lora_server[5]), folders["all"]), tok.encode(prompt), 12)
    assert sql.choices[0].text == tok.decode(ref)
    stream = c.chat.completions.create(model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(ch.model == "sql" for ch in chunks)
    wait_all_blocks_free(aengine.engine)
    assert metric_value(server.url, "sluice_lora_adapters_loaded") >= 1
    assert metric_value(server.url, "sluice_lora_slot_loads") >= 1


def test_unknown_model_is_404_naming_the_adapters(lora_server):
    server = lora_server[0]
    r = httpx.post(f"{server.url}/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "'sql'" in err["message"]


def test_load_and_unload_at_run_time(lora_server):
    server, off, keyed, aengine, folders, _ = lora_server
    load = {"lora_name": "rs", "lora_path": folders["rs"]}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load)
    assert r.status_code == 200, r.text
    assert "added successfully" in r.text
    assert "rs" in {c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert metric_value(server.url, "sluice_lora_adapters_loaded") == 2  # at once, with the engine idle
    out = client(server.url).completions.create(model="rs", prompt="Hello", max_tokens=4, temperature=0)
    assert out.model == "rs" and out.usage.completion_tokens == 4
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load)
    assert again.status_code == 400 and "already loaded" in again.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"})
    assert bad.status_code == 400 and "no adapter_config.json" in bad.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "rs"})
    assert r.status_code == 200 and "removed" in r.text
    assert httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "rs"}).status_code == 404
    gone = httpx.post(f"{server.url}/v1/completions", json={"model": "rs", "prompt": "x", "max_tokens": 1})
    assert gone.status_code == 404
    # Off without the flag; the server's own key only where keys are set.
    r = httpx.post(f"{off.url}/v1/load_lora_adapter", json=load)
    assert r.status_code == 404 and "--enable-lora-updates" in r.json()["error"]["message"]
    assert httpx.post(f"{keyed.url}/v1/load_lora_adapter", json=load).status_code == 401
    r = httpx.post(f"{keyed.url}/v1/load_lora_adapter", json=load, headers={"Authorization": "Bearer sekret"})
    assert r.status_code == 200
    assert httpx.post(f"{keyed.url}/v1/unload_lora_adapter", json={"lora_name": "rs"},
                      headers={"Authorization": "Bearer sekret"}).status_code == 200
    wait_all_blocks_free(aengine.engine)


def test_lora_modules_flag_forms():
    from sluice.entrypoints.cli import build_parser, engine_kwargs, parse_lora_modules
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y=z"}']) == {"a": "/x", "b": "/y=z"}
    for bad, message in ((["a"], "NAME=PATH"), (["a=/x", "a=/y"], "given twice"), (["=/x"], "a name and a path"),
                         (['{"name": "a"}'], "JSON object")):
        with pytest.raises(ValueError, match=message):
            parse_lora_modules(bad)
    args = build_parser().parse_args(["serve", "--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
    kw = engine_kwargs(args)
    assert kw["lora_modules"] == {"a": "/x", "b": "/y"} and kw["max_loras"] == 2 and not kw["enable_lora"]
