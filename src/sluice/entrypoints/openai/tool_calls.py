"""Tool calling on /v1/chat/completions (and /v1/responses): OpenAI's `tools` and
`tool_choice` -> the prompt, the grammar, and the reply's `tool_calls`.

The wire format is Hermes' (Qwen 2.5, Hermes, SmolLM3 and others are trained on it): a
call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A chat template
that takes `tools` renders them and the conversation itself; for one that does not (SmolLM2,
Gemma 3), the tools go into the system message with Hermes' instructions, assistant
`tool_calls` become `<tool_call>` blocks and `tool` messages `<tool_response>` blocks in a
user turn (docs/design.md, "Tool calls").

tool_choice: "none" leaves the tools out and parses nothing; "auto" lets the model answer
or call, and whatever `<tool_call>` blocks it writes are parsed; "required" and a named
function constrain the output to calls (structured/grammar.py), whose arguments follow
each function's JSON schema, so they always parse.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from sluice.entrypoints.openai.errors import APIError
from sluice.structured.grammar import JSON_SPACED, schema_error
from sluice.structured.params import StructuredOutputsParams

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128

SYSTEM_TOOLS = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>")


@dataclass
class Tool:
    name: str
    description: str | None
    parameters: dict

    def as_openai(self) -> dict:
        fn = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


def parse_tools(tools, field: str = "tools") -> list[Tool]:
    """OpenAI function tools (chat's nested form, or the Responses API's flat one)."""
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise APIError(400, f"{field} must be a list of at most {MAX_TOOLS} tools", param=field)
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"{field}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            raise APIError(400, f"{where}: only tools of type 'function' are supported", param=field)
        fn = t.get("function", t)  # chat nests the function; the Responses API does not
        if not isinstance(fn, dict):
            raise APIError(400, f"{where}.function must be an object", param=field)
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(400, f"{where}: a function name must be 1-64 letters, digits, '_', '.' or '-', "
                                f"got {name!r}", param=field)
        if name in seen:
            raise APIError(400, f"{where}: function {name!r} is defined twice", param=field)
        seen.add(name)
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise APIError(400, f"{where}.parameters must be a JSON schema of type object", param=field)
        problem = schema_error(params)
        if problem is not None:
            raise APIError(400, f"{where}.parameters is not a usable JSON schema: {problem}", param=field)
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise APIError(400, f"{where}.description must be a string", param=field)
        out.append(Tool(name, desc, params))
    return out


def parse_tool_choice(choice, tools: list[Tool], field: str = "tool_choice") -> str | Tool | None:
    """"none", "auto", "required" or the named Tool; None when there are no tools."""
    if choice is None:
        return "auto" if tools else None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(400, f"{field} must be 'none', 'auto', 'required' or a function, got {choice!r}",
                           param=field)
        if choice != "none" and not tools:
            raise APIError(400, f"{field}={choice!r} needs tools", param=field)
        return choice if tools else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        fn = choice.get("function", choice)
        name = fn.get("name") if isinstance(fn, dict) else None
        for t in tools:
            if t.name == name:
                return t
        raise APIError(400, f"{field} names function {name!r}, which is not among the tools "
                            f"({', '.join(t.name for t in tools) or 'none given'})", param=field)
    raise APIError(400, f"{field} must be 'none', 'auto', 'required' or {{'type': 'function', 'function': "
                        f"{{'name': ...}}}}", param=field)


def call_schema(tools: list[Tool]) -> dict:
    """The JSON schema of one call's body: {"name": one of the tools, "arguments": its schema}."""
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": JSON_SPACED}  # the separators of every JSON sluice writes


def tool_grammar(tools: list[Tool], parallel: bool) -> StructuredOutputsParams:
    """Calls only: one (or, with parallel calls, one or more) <tool_call> blocks."""
    body = json.dumps(call_schema(tools))
    calls = 'call ("\\n" call)*' if parallel else "call"
    lark = f'start: {calls}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {body}'
    return StructuredOutputsParams(grammar=lark)


def template_takes_tools(template: str | None) -> bool:
    return bool(template) and re.search(r"\btools\b", template) is not None


def render_messages(messages: list[dict], tools: list[Tool], native: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template): as they are for a template that takes tools,
    else the generic Hermes rendering described above."""
    if native:
        out = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [_native_call(c) for c in m["tool_calls"]]
            out.append(m)
        return out, [t.as_openai() for t in tools] or None
    out: list[dict] = []
    if tools:
        text = SYSTEM_TOOLS.format(tools="\n".join(json.dumps(t.as_openai()) for t in tools))
        if messages and messages[0]["role"] == "system":
            out.append({"role": "system", "content": f"{messages[0]['content']}\n\n{text}"})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": text})
    for m in messages:
        role = m["role"]
        if role == "assistant" and m.get("tool_calls"):
            blocks = [f"{OPEN}\n{json.dumps(_native_call(c)['function'])}\n{CLOSE}" for c in m["tool_calls"]]
            content = m.get("content") or ""
            out.append({"role": "assistant", "content": "\n".join(([content] if content else []) + blocks)})
        elif role == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):  # consecutive results share one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_tool_turn"} for m in out], None


def _native_call(call) -> dict:
    """An OpenAI tool call (arguments as a JSON string) as chat templates take it (a dict)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise APIError(400, "messages: an assistant tool_calls entry must be {'type': 'function', "
                            "'function': {'name', 'arguments'}}", param="messages")
    fn = call["function"]
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise APIError(400, f"messages: the arguments of a call to {fn.get('name')!r} are not valid JSON",
                           param="messages") from None
    return {"type": "function", "function": {"name": fn.get("name"), "arguments": args}}


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str   # a JSON string, as OpenAI sends it

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.S)


def parse_output(text: str, tools: list[Tool]) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) from a reply: each well-formed block naming one of the tools is a
    call; the text outside the blocks (or a malformed block) stays content."""
    calls, kept, pos = [], [], 0
    names = {t.name for t in tools}
    for m in _BLOCK.finditer(text):
        call = _call(m.group(1), names)
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls


def _call(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


class StreamParser:
    """Splits a streamed reply into content deltas and finished calls: text that may be the
    start of a <tool_call> is held back until it is known not to be; a call is handed out
    whole once its block closes (or the reply ends)."""

    def __init__(self, tools: list[Tool]):
        self.names = {t.name for t in tools}
        self.buffer = ""
        self.in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        content, new_calls = [], []
        while self.buffer:
            if self.in_call:
                end = self.buffer.find(CLOSE)
                if end == -1 and not final:
                    break
                body = self.buffer[:end] if end != -1 else self.buffer
                self.buffer = self.buffer[end + len(CLOSE):] if end != -1 else ""
                self.in_call = False
                call = _call(body.strip(), self.names)
                if call is None:  # not a call after all: it was content
                    content.append(OPEN + body + (CLOSE if end != -1 else ""))
                else:
                    new_calls.append(call)
                continue
            start = self.buffer.find(OPEN)
            if start != -1:
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(OPEN):]
                self.in_call = True
                continue
            keep = 0 if final else _partial_suffix(self.buffer, OPEN)
            content.append(self.buffer[:len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
            break
        self.calls.extend(new_calls)
        return "".join(content), new_calls


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of token."""
    for n in range(min(len(text), len(token) - 1), 0, -1):
        if token.startswith(text[-n:]):
            return n
    return 0
