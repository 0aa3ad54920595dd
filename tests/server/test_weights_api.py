"""Weight updates and sleep over HTTP (issue 22): from a checkpoint path and from a trainer
process's torch.distributed group (gloo, real processes), with the server's greedy
output then equal to the new model's; bad updates refused whole (400 naming the tensor);
the routes off without --enable-weight-updates and for anyone but the server's key."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from safetensors.torch import save_file

from sluice import LLM, SamplingParams
from sluice.distributed.weight_sync import WeightSender
from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.tenants import TenantSpec
from tests.model.test_weight_updates import new_checkpoint
from tests.server.conftest import MODEL, RunningServer, metric_value, start_engine, wait_all_blocks_free

PROMPT = [1, 450, 6938, 310, 3444, 338]
ADMIN = {"Authorization": "Bearer admin-key"}


@pytest.fixture(scope="module")
def weights_server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    aengine, metrics, _ = start_engine(path, num_blocks=128)
    config = ServerConfig(served_model_name=MODEL, api_key="admin-key", enable_weight_updates=True,
                          tenants=[TenantSpec(name="acme", api_key="tenant-key")])
    server = RunningServer(aengine, config, metrics)
    yield server
    server.stop()
    aengine.shutdown()


def greedy(url: str, headers=ADMIN, prompt=PROMPT, n: int = 12) -> tuple[list, str]:
    r = httpx.post(f"{url}/v1/completions", headers=headers, timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                         "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["logprobs"]["tokens"], body["weight_version"]


def fresh_tokens(path, n: int = 12) -> list[str]:
    out = LLM(model=str(path), dtype="float32", num_blocks=64).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0), use_tqdm=False)[0]
    return [next(iter(d.values())).decoded_token for d in out.outputs[0].logprobs]


def test_routes_are_off_without_the_flag(server):
    r = httpx.post(f"{server.url}/v1/weights/update", json={"path": "/x"})
    assert r.status_code == 404 and "--enable-weight-updates" in r.json()["error"]["message"]
    assert httpx.post(f"{server.url}/sleep").status_code == 404
    info = httpx.get(f"{server.url}/v1/weights").json()
    assert info["weight_version"] == "0" and info["enabled"] is False and info["ranks"] == 1


def test_only_the_servers_key_changes_weights(weights_server):
    url = weights_server.url
    body = {"path": "/nonexistent"}
    assert httpx.post(f"{url}/v1/weights/update", json=body).status_code == 401
    r = httpx.post(f"{url}/v1/weights/update", json=body, headers={"Authorization": "Bearer tenant-key"})
    assert r.status_code == 403 and "--api-key" in r.json()["error"]["message"]
    assert httpx.post(f"{url}/sleep", headers={"Authorization": "Bearer tenant-key"}).status_code == 403
    assert httpx.post(f"{url}/sleep").status_code == 401
    r = httpx.post(f"{url}/v1/weights/update", json=body, headers=ADMIN)
    assert r.status_code == 400 and "/nonexistent" in r.json()["error"]["message"]


def test_update_from_a_path_and_bad_updates(weights_server, tiny_checkpoint, tmp_path):
    url = weights_server.url
    src = tiny_checkpoint("llama")
    before, version = greedy(url)
    new_checkpoint(src, tmp_path / "new", seed=11)
    # A checkpoint with one tensor of the wrong shape is refused whole: nothing changes.
    bad = tmp_path / "bad.safetensors"
    save_file({"model.norm.weight": torch.ones(64), "model.layers.0.mlp.down_proj.weight": torch.ones(3, 3)}, str(bad))
    r = httpx.post(f"{url}/v1/weights/update", json={"path": str(bad)}, headers=ADMIN)
    assert r.status_code == 400, r.text
    assert "model.layers.0.mlp.down_proj.weight" in r.json()["error"]["message"]
    assert greedy(url) == (before, version)
    r = httpx.post(f"{url}/v1/weights/update", json={"path": str(tmp_path / "new"), "weight_version": "ckpt-2"},
                   headers=ADMIN)
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "ckpt-2" and r.json()["tensors"] > 0
    tokens, version = greedy(url)
    assert version == "ckpt-2" and tokens == fresh_tokens(tmp_path / "new") and tokens != before
    assert metric_value(url, "sluice_weight_version_info", 'version="ckpt-2"') == 1
    assert metric_value(url, "sluice_weight_updates_total") >= 1
    httpx.post(f"{url}/v1/weights/update", json={"path": str(src)}, headers=ADMIN).raise_for_status()  # restore


def test_sleep_and_wake_up(weights_server):
    url = weights_server.url
    # Busy: 8 streams of 300-token prompts and 200 outputs are running (the response's
    # headers come once they are queued).
    body = {"model": MODEL, "prompt": [7] * 300, "n": 8, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60, headers=ADMIN) as c, c.stream("POST", f"{url}/v1/completions", json=body):
        r = c.post(f"{url}/sleep")
        assert r.status_code == 409 and "in flight" in r.json()["error"]["message"]
    wait_all_blocks_free(weights_server.engine.engine)
    r = httpx.post(f"{url}/sleep", headers=ADMIN)
    assert r.status_code == 200 and r.json()["freed_bytes"] > 0
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
    r = httpx.post(f"{url}/v1/completions", headers=ADMIN, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_asleep"
    assert metric_value(url, "sluice_engine_asleep") == 1
    assert metric_value(url, "sluice_weight_bytes") == weights_server.engine.engine.weight_bytes > 0
    assert httpx.post(f"{url}/wake_up", headers=ADMIN).status_code == 200
    assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
    greedy(url)


TRAINER = textwrap.dedent("""
    import sys
    from safetensors.torch import load_file
    from sluice.distributed.weight_sync import WeightSender
    url, ckpt = sys.argv[1], sys.argv[2]
    weights = load_file(ckpt)  # the trainer's new model, in float32 as a trainer keeps it
    sender = WeightSender(url, group_name="rl", api_key="admin-key", timeout_s=60)
    answer = sender.update(weights, weight_version="step-1")
    print(answer["weight_version"], answer["tensors"])
    sender.close()
""")


def test_a_trainer_process_pushes_weights_through_a_group(weights_server, tiny_checkpoint, tmp_path):
    """A separate trainer process opens a gloo group with the server and broadcasts new
    weights; the server's greedy output is then the new model's, exactly."""
    url = weights_server.url
    new_checkpoint(tiny_checkpoint("llama"), tmp_path / "new", seed=12)
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    res = subprocess.run([sys.executable, str(script), url, str(tmp_path / "new" / "model.safetensors")],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[0] == "step-1"
    tokens, version = greedy(url)
    assert version == "step-1" and tokens == fresh_tokens(tmp_path / "new")


def test_a_bad_group_update_is_refused_whole(weights_server, tiny_checkpoint):
    url = weights_server.url
    before = greedy(url)
    sender = WeightSender(url, group_name="bad", api_key="admin-key", timeout_s=30)
    try:
        with pytest.raises(RuntimeError, match="model.layers.1.mlp.up_proj.weight"):
            sender.update({"model.norm.weight": torch.zeros(64), "model.layers.1.mlp.up_proj.weight": torch.zeros(5)})
        with pytest.raises(ValueError, match="floating-point"):
            sender.update({"model.norm.weight": torch.zeros(64, dtype=torch.int64)})
        assert greedy(url) == before
    finally:
        sender.close()
    r = httpx.post(f"{url}/v1/weights/update", headers=ADMIN, json={"group_name": "bad", "tensors": [
        {"name": "model.norm.weight", "dtype": "float32", "shape": [64]}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "group_not_found"
    r = httpx.post(f"{url}/v1/weights/init_group", headers=ADMIN, json={
        "master_address": "127.0.0.1", "master_port": 1, "world_size": 2, "group_name": "x", "backend": "nccl"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "backend"
