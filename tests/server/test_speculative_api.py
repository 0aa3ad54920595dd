"""Speculative decoding through the server (SmolLM2, float32): the same text, streamed or
not, as the plain engine (offline); per-request opt-out; the counters in /metrics; bad values 400."""
from __future__ import annotations

import httpx
import pytest
from openai import OpenAI

from sluice import SamplingParams
from sluice.entrypoints.openai.api_server import ServerConfig
from tests.server.conftest import MODEL, RunningServer, metric_value, start_engine, wait_all_blocks_free

PROMPT = ("Repeat the following list exactly: apples, bananas, cherries, dates, elderberries, figs, grapes, "
          "apples, bananas, cherries,")


@pytest.fixture(scope="module")
def spec_server(smollm2_source):
    aengine, metrics, _ = start_engine(str(smollm2_source.path), kv_cache_memory=0.1, speculative_method="ngram",
                                       speculative_gate="always")
    server = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    yield server
    server.stop()
    aengine.shutdown()


def completion(url: str, stream: bool, **extra) -> tuple[str, str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stop=["grapes, apples"], **extra)
    if not stream:
        r = client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    text, reason = "", None
    for chunk in client.completions.create(stream=True, **kw):
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return text, reason


def test_same_text_streamed_or_not_and_counters(spec_server, smollm2_llm):
    spec = spec_server
    # The plain engine's answer: the same model and dtype, offline, without speculation.
    out = smollm2_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=48, stop=["grapes, apples"]))
    want = (out[0].outputs[0].text, out[0].outputs[0].finish_reason)
    assert completion(spec.url, stream=False) == want
    assert completion(spec.url, stream=True) == want
    accepted = metric_value(spec.url, "sluice_spec_decode_tokens", 'kind="accepted"')
    drafted = metric_value(spec.url, "sluice_spec_decode_tokens", 'kind="drafted"')
    assert 0 < accepted <= drafted
    first = f'kind="accepted",model_name="{MODEL}",position="0"'
    assert metric_value(spec.url, "sluice_spec_decode_position_tokens", first) > 0
    assert 0 < metric_value(spec.url, "sluice_spec_decode_acceptance_rate") <= 1
    # Opted out: nothing more is drafted, the text is the same.
    assert completion(spec.url, stream=False, extra_body={"speculative": False}) == want
    assert metric_value(spec.url, "sluice_spec_decode_tokens", 'kind="drafted"') == drafted
    wait_all_blocks_free(spec.engine.engine)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_speculative_field_is_a_400(spec_server, value):
    r = httpx.post(f"{spec_server.url}/v1/completions",
                   json={"model": MODEL, "prompt": "hi", "max_tokens": 2, "speculative": value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "speculative" or "speculative" in r.json()["error"]["message"]


def test_streamed_logprobs_cover_every_token_of_multi_token_steps(spec_server):
    """A verifying step streams several tokens in one chunk: each still gets its logprob."""
    client = OpenAI(base_url=f"{spec_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, logprobs=1)
    whole = client.completions.create(**kw).choices[0].logprobs
    tokens, lps = [], []
    for chunk in client.completions.create(stream=True, **kw):
        lp = chunk.choices[0].logprobs
        if lp is not None:
            tokens += lp.tokens
            lps += lp.token_logprobs
    assert tokens == whole.tokens and len(lps) == len(whole.token_logprobs) == 32
    assert lps == pytest.approx(whole.token_logprobs, abs=1e-4)
