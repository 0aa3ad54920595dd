"""The server over an engine with asynchronous scheduling (the GPU's default): concurrent
streams get the plain engine's text, a client that leaves mid-stream frees its blocks, and
the others go on."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from sluice.entrypoints.openai.api_server import ServerConfig
from tests.server.conftest import MODEL, RunningServer, start_engine, wait_all_blocks_free

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def async_server(tiny_checkpoint):
    aengine, metrics, _ = start_engine(str(tiny_checkpoint("llama")), num_blocks=256, async_scheduling=True,
                                       speculative_method=None)
    assert aengine.engine.overlap
    srv = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    yield srv
    srv.stop()
    aengine.shutdown()


def test_concurrent_streams_match_the_plain_engine(async_server, server):
    from openai import AsyncOpenAI
    prompts = [f"Request number {i} says" for i in range(8)]

    async def run(url: str, leave: bool) -> list[str]:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(i: int) -> str:
            stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=12 + i,
                                                     stream=True, **GREEDY)
            text = ""
            async for chunk in stream:
                text += chunk.choices[0].text if chunk.choices else ""
                if leave and i == 3 and len(text) > 3:
                    await stream.close()  # a client that leaves: its request is aborted
                    return "left"
            return text
        return await asyncio.gather(*[one(i) for i in range(len(prompts))])

    got = asyncio.run(run(async_server.url, leave=True))
    want = asyncio.run(run(server.url, leave=False))
    assert got[3] == "left"
    assert [g for i, g in enumerate(got) if i != 3] == [w for i, w in enumerate(want) if i != 3]
    wait_all_blocks_free(async_server.engine.engine)
    assert httpx.get(f"{async_server.url}/health").status_code == 200
