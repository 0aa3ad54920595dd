"""Data-parallel replicas on a real local Ray cluster behind the router (issue 22): two
replicas of the tiny model, each a Ray actor with its own engine and HTTP server.

Through the router: completions and chat, streamed or not, give one engine's tokens; API
keys; metrics of both replicas with a replica label; a shared prefix stays on one
replica (cache_aware); a session's calls stay on theirs; a client that leaves aborts its
request upstream; weight updates reach both replicas; a replica whose process is killed
ends its requests in flight with a 503 (never a hang), the router stops sending to it,
and Ray brings it back with the last weights (or, when they came from a trainer's group,
out of rotation until the trainer's next group updates it)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import httpx
import pytest

from sluice import LLM, SamplingParams
from sluice.entrypoints.openai.api_server import ServerConfig
from sluice.entrypoints.openai.tenants import TenantSpec
from sluice.entrypoints.router.app import build_router_app
from sluice.entrypoints.router.policy import RouterPolicy
from sluice.entrypoints.router.replicas import ReplicaSet
from tests.model.test_weight_updates import new_checkpoint
from tests.server.conftest import MODEL, free_port, metric_value, serve_process

KEY = {"Authorization": "Bearer sekret"}
DOC = "".join(f"Clause {i}: the tenant shall keep the premises in good repair. " for i in range(30))


class AppServer:
    """Any ASGI app on 127.0.0.1 in a thread."""

    def __init__(self, app):
        import uvicorn
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120  # a hang guard: a start takes seconds, more beside another worker
        while not self.server.started:
            assert time.time() < deadline, "router did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def dp(tiny_checkpoint):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 * 2**20, logging_level="WARNING")
    path = str(tiny_checkpoint("llama"))
    config = ServerConfig(served_model_name=MODEL, api_key="sekret", enable_weight_updates=True,
                          enable_lora_updates=True, tenants=[TenantSpec("lim", "sk-lim", rpm=3, tpm=10**6)])
    replicas = ReplicaSet(ray, 2, dict(model=path, dtype="float32", num_blocks=128, enable_lora=True), config,
                          replica_cpus=1, threads=1)
    try:
        asyncio.run(replicas.start(timeout=300))
        policy = RouterPolicy(2, "cache_aware")
        router = AppServer(build_router_app(replicas, policy, config))
        yield router, replicas, policy, path
        router.stop()
    finally:
        replicas.shutdown()
        ray.shutdown()


def complete(url: str, prompt, n: int = 8, **extra) -> dict:
    r = httpx.post(f"{url}/v1/completions", headers=KEY, timeout=60, json={
        "model": MODEL, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def total(url: str, name: str, *labels: str) -> float:
    """The sum of a metric's samples over replicas that carry every one of `labels`."""
    out = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{") and all(label in line for label in labels):
            out += float(line.rsplit(" ", 1)[1])
    return out


def decisions(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("sluice_router_requests_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["replica"].strip('"'), labels["decision"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_completions_and_chat_through_the_router(dp):
    router, replicas, _, path = dp
    from openai import OpenAI
    client = OpenAI(base_url=f"{router.url}/v1", api_key="sekret", max_retries=0, timeout=60)
    ref = LLM(model=path, dtype="float32", num_blocks=64).generate(
        "The weather today is", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    want = ref[0].outputs[0].text
    r = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    stream = client.completions.create(model=MODEL, prompt="The weather today is", max_tokens=8, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          stream=True)
    assert [c for c in chat if c.choices and c.choices[0].finish_reason == "length"]
    assert httpx.post(f"{router.url}/v1/completions", json={"model": MODEL, "prompt": "x"}).status_code == 401
    assert client.models.list().data[0].id == MODEL
    assert client.models.retrieve(MODEL).id == MODEL
    stored = client.responses.create(model=MODEL, input="hello", max_output_tokens=2)
    assert client.responses.input_items.list(stored.id).data[0].content[0].text == "hello"  # found where stored
    tokens = httpx.post(f"{router.url}/tokenize", json={"prompt": "The weather"},
                        headers={"Authorization": "Bearer sekret"}).json()["tokens"]
    assert httpx.post(f"{router.url}/detokenize", json={"tokens": tokens},
                      headers={"Authorization": "Bearer sekret"}).json()["prompt"] == "The weather"
    info = httpx.get(f"{router.url}/tokenizer_info", headers={"Authorization": "Bearer sekret"})
    assert info.status_code == 200 and info.json()["eos_token"]
    lines = httpx.get(f"{router.url}/metrics").text.splitlines()
    for i in (0, 1):  # every replica's series (those it has set so far), with its label
        assert any(ln.startswith("sluice_weight_version_info{") and f'replica="{i}"' in ln for ln in lines)
        assert f'sluice_router_replica_up{{replica="{i}"}} 1.0' in lines


def test_a_shared_prefix_stays_on_one_replica_and_hits_its_cache(dp):
    router, *_ = dp
    before = decisions(router.url)
    for q in range(5):
        complete(router.url, DOC + f" Question {q}: who repairs the roof?", n=2)
    new = {k: v - before.get(k, 0) for k, v in decisions(router.url).items() if v != before.get(k, 0)}
    hits = {k: v for k, v in new.items() if k[1] == "cache_hit"}
    assert len(hits) == 1 and sum(hits.values()) == 4, new  # the first was a miss, the rest all went to it
    (replica, _), = hits
    hit_tokens = total(router.url, "sluice_prefix_cache_hits_total", f'replica="{replica}"')
    assert hit_tokens >= 4 * 100  # ~460 shared tokens each time, in whole blocks


def test_a_sessions_calls_stay_on_its_replica(dp):
    router, *_ = dp
    before = decisions(router.url)
    history = "You are a tool-using agent."
    for turn in range(4):
        out = complete(router.url, history, n=4, session_id="agent-7")
        history += out["choices"][0]["text"] + f" Tool result {turn}."
    new = {k: v - before.get(k, 0) for k, v in decisions(router.url).items() if v != before.get(k, 0)}
    session = {k: v for k, v in new.items() if k[1] == "session"}
    assert len(session) == 1 and sum(session.values()) == 3, new
    r = httpx.delete(f"{router.url}/v1/sessions/agent-7", headers=KEY)
    assert r.status_code == 200 and r.json()["released_blocks"] > 0
    assert httpx.delete(f"{router.url}/v1/sessions/agent-7", headers=KEY).status_code == 404


def test_a_client_that_leaves_aborts_its_request_upstream(dp):
    """The replicas are processes of their own (no StepGate): the request's 400 steps (no
    drafts, one token a step) must outlast the abort's way through the router, a bound
    that a slower machine keeps, since it slows both alike."""
    router, *_ = dp
    aborted = total(router.url, "sluice_requests_finished_total", 'finished_reason="abort"')
    body = {"model": MODEL, "prompt": [7] * 100, "n": 4, "max_tokens": 400, "ignore_eos": True, "stream": True,
            "speculative": False}
    with httpx.Client(timeout=60, headers=KEY) as c, c.stream("POST", f"{router.url}/v1/completions", json=body) as s:
        next(s.iter_lines())
    deadline = time.time() + 30  # a hang guard
    while time.time() < deadline:
        now = total(router.url, "sluice_requests_finished_total", 'finished_reason="abort"')
        if now >= aborted + 4:
            break
        time.sleep(0.1)
    assert now >= aborted + 4


def test_a_trainer_group_spans_every_replica(dp, tmp_path):
    """A trainer's group through the router: each replica joins as a rank of its own
    (world size 3), receives the same broadcasts, and runs the new weights."""
    from safetensors.torch import load_file

    from sluice.distributed.weight_sync import WeightSender
    router, replicas, _, path = dp
    new_checkpoint(path, tmp_path / "new", seed=22)
    sender = WeightSender(router.url, group_name="rl", api_key="sekret", timeout_s=60)
    try:
        assert sender.group.world_size == 3
        answer = sender.update(load_file(str(tmp_path / "new" / "model.safetensors")), weight_version="step-3")
    finally:
        sender.close()
    assert answer["weight_version"] == "step-3" and set(answer["replicas"]) == {"0", "1"}
    want = LLM(model=str(tmp_path / "new"), dtype="float32", num_blocks=64).generate(
        DOC, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    for url in replicas.urls:
        out = complete(url, DOC, n=6)
        assert out["choices"][0]["text"] == want and out["weight_version"] == "step-3"


def test_weight_updates_reach_every_replica(dp, tmp_path):
    router, replicas, _, path = dp
    new_checkpoint(path, tmp_path / "new", seed=21)
    assert httpx.get(f"{router.url}/v1/weights", headers=KEY).json()["ranks"] == 2
    r = httpx.post(f"{router.url}/v1/weights/update", headers=KEY, timeout=60,
                   json={"path": str(tmp_path / "new"), "weight_version": "v9"})
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == "v9"
    want = LLM(model=str(tmp_path / "new"), dtype="float32", num_blocks=64).generate(
        DOC, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    for url in replicas.urls:  # each replica directly
        out = complete(url, DOC, n=6)
        assert out["choices"][0]["text"] == want and out["weight_version"] == "v9"
    assert httpx.post(f"{router.url}/sleep", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_rate_limits_hold_across_replicas(dp):
    """The router holds a tenant's limits: 3 requests a minute in all, whichever replicas
    serve them (the replicas' own copies of the tenant have none); its tokens are charged as
    the replicas report them."""
    router, replicas, _, _ = dp
    quotas = router.server.config.app.state.quotas
    quotas.clock = lambda: 5000.0  # frozen: nothing refills during the test, however slow the machine
    st = quotas._tenants["lim"]
    st.requests.t = st.tokens.t = 5000.0
    lim = {"Authorization": "Bearer sk-lim"}
    codes = [httpx.post(f"{router.url}/v1/completions", headers=lim, timeout=60, json={
        "model": MODEL, "prompt": f"request {i} " * (i + 1), "max_tokens": 4}).status_code for i in range(4)]
    assert codes == [200, 200, 200, 429], codes
    assert metric_value(router.url, "sluice_router_rate_limited", 'tenant="lim"') == 1
    direct = [httpx.post(f"{url}/v1/completions", headers=lim, timeout=60, json={
        "model": MODEL, "prompt": "direct", "max_tokens": 1}).status_code for url in replicas.urls for _ in range(2)]
    assert direct == [200] * 4
    deadline = time.time() + 60  # a hang guard: the router reads the replicas' counters every second
    while st.tokens.level > 10**6 - 3 * 5:
        assert time.time() < deadline, "the replicas' token counts never reached the router"
        time.sleep(0.1)


def test_a_lora_adapter_loads_on_every_replica(dp, tmp_path_factory):
    from tests.model.test_lora import ADAPTERS, make_adapter
    router, replicas, _, path = dp
    folder = tmp_path_factory.mktemp("dp-lora") / "all"  # kept for the restart test below
    make_adapter(path, folder, 0, **ADAPTERS["all"])
    r = httpx.post(f"{router.url}/v1/load_lora_adapter", headers=KEY, json={"lora_name": "a", "lora_path": str(folder)})
    assert r.status_code == 200 and "added successfully" in r.text, r.text
    for url in replicas.urls:
        assert "a" in {c["id"] for c in httpx.get(f"{url}/v1/models", headers=KEY).json()["data"]}
    texts = {complete(url, DOC, n=6, model="a")["choices"][0]["text"] for url in replicas.urls}
    assert len(texts) == 1 and texts != {complete(router.url, DOC, n=6)["choices"][0]["text"]}
    bad = httpx.post(f"{router.url}/v1/load_lora_adapter", headers=KEY, json={"lora_name": "b", "lora_path": "/no"})
    assert bad.status_code == 400


def test_a_killed_replica_ends_its_requests_with_503_and_comes_back(dp):
    router, replicas, policy, _ = dp
    # A long stream and a non-streaming request on the same replica (one session).
    # No drafts: one token a step, so the stream's 4 x 480 tokens outlast the test's setup.
    body = {"model": MODEL, "prompt": [9] * 20, "max_tokens": 480, "ignore_eos": True, "session_id": "victim",
            "speculative": False}
    result = {}

    def blocking():
        result["r"] = httpx.post(f"{router.url}/v1/completions", headers=KEY, timeout=60, json=body)

    with httpx.Client(timeout=60, headers=KEY) as c, \
            c.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True, "n": 4}) as s:
        lines = s.iter_lines()
        next(lines)
        victim = policy.sessions[("", "victim")]
        t = threading.Thread(target=blocking)
        t.start()
        deadline = time.time() + 60  # a hang guard: until both requests are in the victim's engine
        while total(replicas.urls[victim], "sluice_num_requests_running") + \
                total(replicas.urls[victim], "sluice_num_requests_waiting") < 5:
            assert time.time() < deadline, "the requests did not reach their replica"
            time.sleep(0.02)
        os.kill(asyncio.run(replicas.pid(victim)), signal.SIGKILL)
        t0 = time.time()
        events = [line for line in lines if line.startswith("data: ")]
        t.join(30)
    assert time.time() - t0 < 30
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["error"]["code"] == "replica_unavailable"
    assert result["r"].status_code == 503 and result["r"].json()["error"]["code"] == "replica_unavailable"
    # Meanwhile every request goes to the other replica, and succeeds.
    before = decisions(router.url)
    for i in range(4):
        complete(router.url, f"request {i} while one replica is down", n=2)
    new = {k: v - before.get(k, 0) for k, v in decisions(router.url).items() if v != before.get(k, 0)}
    assert {k[0] for k in new} == {str(1 - victim)}, new
    # Ray restarts it; the router finds it again and gives it the last update's weights.
    deadline = time.time() + 300  # a hang guard: a restart takes seconds, more on a loaded machine
    while not replicas.up[victim]:
        assert time.time() < deadline, "the killed replica did not come back"
        time.sleep(0.5)
    assert replicas.restarts[victim] == 1
    versions = httpx.get(f"{router.url}/v1/weights", headers=KEY).json()
    assert versions["weight_version"] == "v9", versions
    # and the LoRA adapter loaded at run time.
    assert "a" in {c["id"] for c in httpx.get(f"{replicas.urls[victim]}/v1/models", headers=KEY).json()["data"]}
    assert metric_value(router.url, "sluice_router_replica_restarts", f'replica="{victim}"') == 1


def test_a_replica_restarted_after_a_group_update_waits_out_of_rotation_for_the_next(dp, tmp_path):
    """Weights broadcast by a trainer cannot be replayed to a restarted replica: it stays out
    of rotation (serving its checkpoint's weights to nobody) until the trainer's next group,
    which includes it, gives it the new weights."""
    from safetensors.torch import load_file

    from sluice.distributed.weight_sync import WeightSender
    router, replicas, _, path = dp
    new_checkpoint(path, tmp_path / "new", seed=23)
    tensors = load_file(str(tmp_path / "new" / "model.safetensors"))
    sender = WeightSender(router.url, group_name="rl-a", api_key="sekret", timeout_s=60)
    try:
        sender.update(tensors, weight_version="step-5")
    finally:
        sender.close()
    victim = 0
    restarts = replicas.restarts[victim]
    os.kill(asyncio.run(replicas.pid(victim)), signal.SIGKILL)
    deadline = time.time() + 300  # a hang guard: a restart takes seconds, more on a loaded machine
    while replicas.restarts[victim] == restarts or not replicas.up[victim]:
        assert time.time() < deadline, "the killed replica did not come back"
        time.sleep(0.5)
    assert replicas.stale[victim] and replicas.healthy() == [1]
    assert f'sluice_router_replica_up{{replica="{victim}"}} 0.0' in httpx.get(f"{router.url}/metrics").text
    answer = httpx.get(f"{router.url}/v1/weights", headers=KEY).json()
    assert answer["weight_version"] is None  # the replicas disagree, and say so
    assert answer["replicas"][str(victim)]["weight_version"] != "step-5"
    before = decisions(router.url)
    for i in range(3):
        assert complete(router.url, f"call {i} while one replica is stale", n=2)["weight_version"] == "step-5"
    new = {k: v - before.get(k, 0) for k, v in decisions(router.url).items() if v != before.get(k, 0)}
    assert {k[0] for k in new} == {"1"}, new
    # The trainer's next group spans both replicas again, and the update puts it back.
    sender = WeightSender(router.url, group_name="rl-b", api_key="sekret", timeout_s=60)
    try:
        assert sender.group.world_size == 3
        sender.update(tensors, weight_version="step-6")
    finally:
        sender.close()
    assert not replicas.stale[victim] and replicas.healthy() == [0, 1]
    want = LLM(model=str(tmp_path / "new"), dtype="float32", num_blocks=64).generate(
        DOC, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    out = complete(replicas.urls[victim], DOC, n=6)
    assert out["choices"][0]["text"] == want and out["weight_version"] == "step-6"


def test_sluice_serve_with_two_replicas_of_two_ranks_as_a_process(tiny_checkpoint):
    """The command a user runs: its own local Ray cluster, 2 replicas, each a tensor-parallel
    engine of 2 ranks, the router; SIGTERM stops it all, every rank process included, and
    exits 0."""
    import psutil
    proc, url = serve_process("--model", str(tiny_checkpoint("llama")), "--dtype", "float32", "--num-blocks", "64",
                              "--data-parallel-size", "2", "--tensor-parallel-size", "2", "--served-model-name", MODEL,
                              timeout=300)
    try:
        for i in range(2):  # short texts take turns: one on each replica
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 3},
                           timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        metrics = httpx.get(f"{url}/metrics").text
        for i in (0, 1):
            assert f'sluice_router_replica_up{{replica="{i}"}} 1.0' in metrics
            assert total(url, "sluice_requests_finished_total", f'replica="{i}"') == 1
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True)
                 if "sluice.distributed.tp_rank" in " ".join(c.cmdline())]
        assert len(ranks) == 2  # each replica's second rank
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(ranks, timeout=30)
        assert not alive, alive
    finally:
        if proc.poll() is None:
            proc.kill()
