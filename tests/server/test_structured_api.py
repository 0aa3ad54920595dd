"""Structured outputs, tool calls and the Responses API through the `openai` client, on the
tiny random Llama: whatever the model's weights, the grammar makes its output parse."""
from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL, metric_value, wait_all_blocks_free

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "hour_offset": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["hour_offset"],
        "additionalProperties": False}}}
BOUNDED = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                            "ok": {"type": "boolean"}, "c": {"enum": ["x", "y"]}},
           "required": ["n", "ok", "c"], "additionalProperties": False}


class Verdict(BaseModel):
    label: Literal["spam", "ham"]
    score: int = Field(ge=0, le=10)
    flagged: bool


def test_chat_parse_with_a_pydantic_model(client, server):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Classify: win money"}],
                                      response_format=Verdict, max_completion_tokens=60, temperature=1.0, seed=3)
    verdict = r.choices[0].message.parsed
    assert isinstance(verdict, Verdict) and r.choices[0].finish_reason == "stop"
    wait_all_blocks_free(server.llm)


def test_json_schema_json_object_regex_choice_on_both_endpoints(client):
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}], seed=seed,
                                           temperature=1.0, max_completion_tokens=60, response_format=rf)
        jsonschema.validate(json.loads(r.choices[0].message.content), BOUNDED)
    r = client.completions.create(model=MODEL, prompt="Numbers:", max_tokens=30, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-c]{3}"}})
    assert r.choices[0].finish_reason == "stop" and len(r.choices[0].text) == 6
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=2,
                                  extra_body={"guided_choice": ["left", "right"]})
    assert r.choices[0].text in ("left", "right")
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}], max_tokens=40,
                                       extra_body={"structured_outputs": {"json": BOUNDED}})
    jsonschema.validate(json.loads(r.choices[0].message.content), BOUNDED)


def test_streamed_json_reassembles(client, server):
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": BOUNDED}}
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go"}],
                                                 seed=5, temperature=1.0, max_tokens=60, response_format=rf,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), BOUNDED)
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_all_blocks_free(server.llm)
    # Every sampled token was masked; the counters say so (and how long masks took).
    assert metric_value(server.url, "sluice_grammar_rows_total") >= len(server.llm.tokenizer.encode(text)) - 1
    assert metric_value(server.url, "sluice_grammar_mask_fill_seconds_total") > 0
    assert metric_value(server.url, "sluice_grammar_compiles_total") >= 1


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "(["}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "array", "uniqueItems": True}}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_grammar": "start: nothing_here"}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_specs_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    wait_all_blocks_free(server.llm)


def test_a_slow_compile_is_refused_and_others_go_on(client, server, monkeypatch):
    """A grammar still compiling at the time limit is a 400; the server goes on serving.
    (Compiling is made slow here: llguidance compiles lazily, so a real grammar that takes
    seconds to compile is hard to write; the cost would show in the masks, which its
    parser limits bound.)"""
    import time as _time
    grammars = server.llm.grammars
    compile_ = grammars.compile
    monkeypatch.setattr(grammars, "compile", lambda spec: (_time.sleep(1.0), compile_(spec))[1])
    monkeypatch.setattr(grammars, "compile_timeout_s", 0.2)
    r = httpx.post(f"{server.url}/v1/completions", timeout=30, json={
        "model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "[a-f]{7}"}})
    assert r.status_code == 400 and "to compile" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "structured_outputs"
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt="still", max_tokens=3).choices[0].text is not None
    wait_all_blocks_free(server.llm)


def test_tool_choice_required_and_named(client, server):
    msgs = [{"role": "user", "content": "Weather in Paris and the time?"}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required",
                                       parallel_tool_calls=False, temperature=1.0, seed=4, max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    # Parallel calls: one or more (the random model may go on adding calls until max_tokens).
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK], tool_choice="required",
                                       temperature=1.0, seed=4, max_tokens=160)
    assert r.choices[0].message.tool_calls
    for call in choice.message.tool_calls + r.choices[0].message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       temperature=1.0, seed=1, max_tokens=60)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_time"])
    # none: no calls parsed, whatever the text
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="none", max_tokens=5)
    assert r.choices[0].message.tool_calls is None
    wait_all_blocks_free(server.llm)


def test_streamed_tool_call_deltas_reassemble(client, server):
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    kwargs = dict(model=MODEL, messages=msgs, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=9,
                  max_tokens=80, parallel_tool_calls=False)
    full = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function:
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in full]
    wait_all_blocks_free(server.llm)


def test_auto_parses_calls_the_model_writes_and_history_renders(client):
    """tool_choice auto: a reply that holds a <tool_call> block comes back as tool_calls
    (here the reply is forced with a choice, the tiny model would not write one), and a
    history with assistant tool_calls and tool results is accepted."""
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n</tool_call>'
    kwargs = dict(model=MODEL, tools=[WEATHER], max_tokens=60, extra_body={"structured_outputs": {"choice": [written]}})
    msgs = [{"role": "user", "content": "Weather in Oslo?"}]
    r = client.chat.completions.create(messages=msgs, **kwargs)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert json.loads(call.function.arguments) == {"city": "Oslo", "unit": "celsius"}
    deltas = [c.choices[0].delta for c in client.chat.completions.create(messages=msgs, stream=True, **kwargs)
              if c.choices]
    assert not "".join(d.content or "" for d in deltas)  # the block is not leaked as content
    assert [t.function.name for d in deltas for t in d.tool_calls or [] if t.function.name] == ["get_weather"]
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": '{"temp": -3}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=5)
    assert r.choices[0].message.role == "assistant"


def test_responses_plain_streamed_and_stored(client, server):
    r = client.responses.create(model=MODEL, input="Say something", instructions="Be brief.", max_output_tokens=8,
                                temperature=0)
    assert r.object == "response" and r.status == "incomplete" and r.output_text
    assert r.usage.output_tokens == 8 and r.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL, input="Say something", instructions="Be brief.",
                                          max_output_tokens=8, temperature=0, stream=True, store=False))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "Say something")]
    many = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
        {"role": "user", "content": [{"type": "input_text", "text": "three"}]}])
    newest = client.responses.input_items.list(many.id, limit=2)  # OpenAI's default order: newest first
    assert [i.content[0].text for i in newest.data] == ["three", "two"] and newest.has_more
    rest = client.responses.input_items.list(many.id, after=newest.last_id)
    assert [i.content[0].text for i in rest.data] == ["one"] and not rest.has_more
    assert [i.content[0].text for i in client.responses.input_items.list(many.id, order="asc").data] == \
        ["one", "two", "three"]
    with pytest.raises(Exception, match="400"):
        client.responses.input_items.list(many.id, limit=0)
    client.responses.delete(r.id)
    with pytest.raises(Exception, match="404"):
        client.responses.retrieve(r.id)
    with pytest.raises(Exception, match="404"):
        client.responses.input_items.list(r.id)
    client.responses.delete(many.id)
    wait_all_blocks_free(server.llm)


def test_responses_function_round_trip_with_previous_response_id(client, server):
    tool = {"type": "function", **WEATHER["function"]}  # the Responses API's flat form
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[tool], tool_choice="required",
                                    parallel_tool_calls=False, temperature=1.0, max_output_tokens=80)
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and first.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[tool], max_output_tokens=6,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": '{"temp": 21}'}], temperature=0)
    assert second.previous_response_id == first.id and second.output_text
    # The follow-up's prompt holds the first call's whole conversation: more prompt tokens.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the history's KV was reused
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False, temperature=1.0, max_output_tokens=80,
                                          stream=True, store=False))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)["city"] in ("Paris", "Rome", "Oslo")
    assert events[-1].type == "response.completed"
    with pytest.raises(Exception, match="404"):
        client.responses.create(model=MODEL, input="x", previous_response_id="resp_missing")
    # The chain was one session: deleting a response of it releases the pinned KV.
    assert server.llm.scheduler.sessions.num_pinned > 0
    client.responses.delete(second.id)
    wait_all_blocks_free(server.llm)


def test_responses_text_format_json_schema(client, server):
    r = client.responses.create(model=MODEL, input="Go", temperature=1.0, max_output_tokens=60, store=False,
                                text={"format": {"type": "json_schema", "name": "b", "schema": BOUNDED}})
    jsonschema.validate(json.loads(r.output_text), BOUNDED)
    wait_all_blocks_free(server.llm)  # not stored: no session pinned for it
