"""Reasoning output through the `openai` client (--reasoning-parser): a tiny random Qwen3
whose vocabulary has <think> and </think> as single tokens and whose template is Qwen3's
shape (enable_thinking false closes the thinking in the prompt). Whatever the weights,
logit_bias and the grammar decide the parts of the output that the tests look at."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch

from tests.conftest import make_tiny_config
from tests.server.conftest import MODEL, RunningServer, start_engine, wait_all_blocks_free

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if opens_thinking is defined and opens_thinking %}<think>\n{% endif %}"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory, hf_tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tmp_path_factory.mktemp("thinking-qwen3")
    hf_tokenizer.save_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    cfg = make_tiny_config("qwen3")
    cfg.vocab_size = len(tok)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.float32).save_pretrained(path)
    return path, tok.convert_tokens_to_ids("<think>"), tok.convert_tokens_to_ids("</think>")


@pytest.fixture(scope="module")
def servers(thinking_checkpoint):
    """parser -> (server, (<think> id, </think> id)), one engine per parser, started on first use."""
    from sluice.entrypoints.openai.api_server import ServerConfig
    running = {}

    def get(parser):
        if parser not in running:
            aengine, metrics, _ = start_engine(str(thinking_checkpoint[0]), num_blocks=128, reasoning_parser=parser)
            running[parser] = aengine, RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
        return running[parser][1], thinking_checkpoint[1:]
    yield get
    for aengine, srv in running.values():
        srv.stop()
        aengine.shutdown()


@pytest.fixture()
def r1(servers):
    return servers("deepseek_r1")


@pytest.fixture()
def qwen3(servers):
    return servers("qwen3")


def client_of(srv):
    from openai import OpenAI
    return OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)


ASK = [{"role": "user", "content": "Pick a digit."}]
R1_PROMPT = {"chat_template_kwargs": {"opens_thinking": True}}  # the template opens the thinking, as R1's does


def test_grammar_waits_for_the_end_of_thinking(r1):
    """logit_bias makes </think> the first token (no grammar yet); from then on the JSON
    schema applies: no reasoning, an answer that validates. (A grammar applied from the
    first token would have refused </think>, and all the output would be reasoning.)"""
    srv, (_, end) = r1
    r = client_of(srv).chat.completions.create(
        model=MODEL, messages=ASK, max_completion_tokens=40, temperature=0, logit_bias={str(end): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA}},
        extra_body=R1_PROMPT)
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    jsonschema.validate(json.loads(msg.content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    wait_all_blocks_free(srv.engine.engine)


def test_unclosed_thinking_is_all_reasoning_whole_and_streamed(r1):
    """Without the end tag every output token is reasoning: in reasoning_content, streamed as
    its own deltas that add up to the whole; the Responses API gives one reasoning item."""
    srv, _ = r1
    client = client_of(srv)
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=10, temperature=0,
                                           extra_body=R1_PROMPT).choices[0].message
    assert whole.content is None and whole.reasoning_content
    thought, content = "", ""
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=10, temperature=0,
                                                stream=True, extra_body=R1_PROMPT):
        for c in chunk.choices:
            thought += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (thought, content) == (whole.reasoning_content, "")
    # Responses: deepseek_r1's output starts inside the thinking (the format's rule), so
    # without an end tag it is one reasoning item, streamed as reasoning_text deltas.
    # (store false: a stored response's session would keep its blocks pinned for a follow-up)
    resp = client.responses.create(model=MODEL, input="Pick a digit.", max_output_tokens=6, temperature=0,
                                   store=False)
    assert [it.type for it in resp.output] == ["reasoning"]
    assert resp.output[0].content[0].text and resp.usage.output_tokens_details.reasoning_tokens == 6
    with httpx.stream("POST", f"{srv.url}/v1/responses", json={"model": MODEL, "input": "Pick a digit.",
                                                               "max_output_tokens": 6, "temperature": 0,
                                                               "stream": True, "store": False}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == resp.output[0].content[0].text
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["item"]["type"] for e in done] == ["reasoning"]
    wait_all_blocks_free(srv.engine.engine)


def test_qwen3_thinking_switched_off_in_the_prompt(qwen3):
    """enable_thinking false: the template closes the thinking, so the grammar applies from
    the first token and all the output is the answer."""
    srv, _ = qwen3
    r = client_of(srv).chat.completions.create(
        model=MODEL, messages=ASK, max_completion_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "d", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = r.choices[0].message
    assert getattr(msg, "reasoning_content", None) is None
    jsonschema.validate(json.loads(msg.content), SCHEMA)


def test_qwen3_output_without_tags_is_the_answer_and_thinking_is_split(qwen3):
    srv, (start, end) = qwen3
    client = client_of(srv)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=6, temperature=0)
    assert plain.choices[0].message.content and getattr(plain.choices[0].message, "reasoning_content", None) is None
    # <think> forced first and kept up: reasoning only (the opening tag itself is not in it).
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=4, temperature=0,
                                       logit_bias={str(start): 100})
    assert r.choices[0].message.reasoning_content == "<think>" * 3 and r.choices[0].message.content is None
    wait_all_blocks_free(srv.engine.engine)
