"""Tool calls without a model: tools and tool_choice checks, the generic Hermes rendering,
parsing replies whole and streamed (every split of the text gives the same calls)."""
from __future__ import annotations

import json

import pytest

from sluice.entrypoints.openai.errors import APIError
from sluice.entrypoints.openai.tool_calls import (StreamParser, parse_output, parse_tool_choice, parse_tools,
                                                  render_messages, tool_grammar)

TOOLS = parse_tools([{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}, {"type": "function", "name": "noop"}])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_tools_and_choice_checks():
    assert [t.name for t in TOOLS] == ["get_weather", "noop"] and TOOLS[1].parameters["type"] == "object"
    assert parse_tool_choice(None, TOOLS) == "auto" and parse_tool_choice(None, []) is None
    assert parse_tool_choice({"type": "function", "function": {"name": "noop"}}, TOOLS) is TOOLS[1]
    for bad in ("sometimes", {"type": "function", "function": {"name": "x"}}, 3):
        with pytest.raises(APIError) as e:
            parse_tool_choice(bad, TOOLS)
        assert e.value.param == "tool_choice"
    with pytest.raises(APIError, match="defined twice"):
        parse_tools([{"type": "function", "name": "a"}, {"type": "function", "name": "a"}])


def test_parse_whole_replies():
    assert parse_output("Hello", TOOLS) == ("Hello", [])
    content, calls = parse_output("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"), TOOLS)
    assert content == "Let me check." and [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]
    assert len({c.id for c in calls}) == 2
    # A block naming an unknown tool, or broken JSON, stays text.
    bad = CALL.replace("get_weather", "launch")
    assert parse_output(bad, TOOLS) == (bad, [])
    assert parse_output("<tool_call>\n{oops\n</tool_call>", TOOLS)[1] == []
    # Arguments given as a JSON string are taken too; an unclosed last block at the end is a call.
    _, (c,) = parse_output('<tool_call>{"name": "noop", "arguments": "{}"}', TOOLS)
    assert c.name == "noop" and c.arguments == "{}"


@pytest.mark.parametrize("text", ["Sure.\n" + CALL, CALL + "\n" + CALL, "a < b <tool", "<tool_call>\n{oops}"])
def test_streamed_parsing_matches_whole_for_every_split(text):
    whole_content, whole_calls = parse_output(text, TOOLS)
    for step in (1, 2, 3, 7, len(text)):
        p = StreamParser(TOOLS)
        content, calls = "", []
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        for i, piece in enumerate(pieces):
            d, c = p.feed(piece, final=i == len(pieces) - 1)
            content += d
            calls += c
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        if whole_calls:
            assert content.strip() == (whole_content or "")
        else:
            assert content == text


def test_generic_rendering():
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
               {"role": "tool", "tool_call_id": "call_2", "content": "sunny"}]
    msgs, template_tools = render_messages(history, TOOLS, native=False)
    assert template_tools is None and [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    assert msgs[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in msgs[0]["content"]
    assert msgs[2]["content"] == CALL
    assert msgs[3]["content"] == "<tool_response>\n21 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    native, tools = render_messages(history, TOOLS, native=True)
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"} and len(tools) == 2


def test_tool_grammar_shape():
    g = tool_grammar(TOOLS, parallel=True).grammar
    assert g.startswith('start: call ("\\n" call)*') and '"const": "get_weather"' in g
    assert "call (" not in tool_grammar(TOOLS[:1], parallel=False).grammar
