"""`--deterministic` through the server: a completion's tokens and logprobs are bitwise
those of its solo run while other clients' requests stream beside it."""
from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import OpenAI

from tests.server.conftest import MODEL, RunningServer, StepGate, start_engine, wait_all_blocks_free
from sluice.entrypoints.openai.api_server import ServerConfig

pytestmark = pytest.mark.requires("kernels")

PROBE = "The quick brown fox jumps over the lazy dog and then"


@pytest.fixture(scope="module")
def det_server(tiny_checkpoint):
    # A small cache and step budget: the crowd forces chunked prompts and preemption.
    aengine, metrics, _ = start_engine(str(tiny_checkpoint("llama")), deterministic=True, num_blocks=24,
                                       max_num_batched_tokens=64)
    server = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    yield server
    server.stop()
    aengine.shutdown()


def probe(client: OpenAI, **extra):
    r = client.completions.create(model=MODEL, prompt=PROBE, max_tokens=16, logprobs=3, **extra)
    lp = r.choices[0].logprobs
    return r.choices[0].text, lp.tokens, lp.token_logprobs, lp.top_logprobs


def neighbour(client: OpenAI, i: int) -> None:
    rng = random.Random(i)
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(rng.randint(20, 80)))
    stream = client.completions.create(model=MODEL, prompt=words, max_tokens=rng.randint(20, 50),
                                       temperature=1.0, stream=True)
    for _ in stream:
        pass


def outgrower(client: OpenAI) -> None:
    """Eight samples added to the engine at once that never stop early: prompt + 60 tokens
    each is 6 blocks, 2 of them the shared prompt's, so 2 + 8 x 4 = 34 blocks of the 24,
    however the other requests come and go: someone is preempted, certainly."""
    words = " ".join(["alpha", "beta", "gamma", "delta"] * 8)
    r = client.completions.create(model=MODEL, prompt=words, max_tokens=60, n=8, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    assert len(r.choices) == 8 and all(c.finish_reason == "length" for c in r.choices)


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=0.8, seed=11)])
def test_probe_bitwise_equal_with_and_without_neighbours(det_server, sampling):
    client = OpenAI(base_url=f"{det_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    alone = probe(client, **sampling)
    scheduler = det_server.engine.engine.scheduler
    preempted = scheduler.num_preemptions
    # Everyone is queued before the first step (StepGate), so the probes share their steps
    # with the crowd however slowly this machine sends it.
    with StepGate(det_server.engine) as gate, ThreadPoolExecutor(17) as pool:
        futures = [pool.submit(neighbour, client, i) for i in range(14)] + [pool.submit(outgrower, client)]
        crowded = [pool.submit(probe, client, **sampling) for _ in range(2)]
        gate.wait_until(lambda e: e.scheduler.num_waiting == 14 + 8 + 2, "the crowd to be queued")
        gate.open()
        results = [f.result() for f in crowded]
        for f in futures:
            f.result()
    for got in results:
        assert got == alone
    assert scheduler.num_preemptions > preempted
    wait_all_blocks_free(det_server.engine.engine)
