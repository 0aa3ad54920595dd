"""POST /v1/responses: OpenAI's Responses API over the chat machinery of serving.py.

`input` (a string, or message / function_call / function_call_output items) and
`instructions` become chat messages; `tools`, `tool_choice` and `text.format` work as
chat's tools and response_format do; the reply becomes output items (a message with
output_text, function_call items). `stream` sends the Responses event sequence
(response.created ... response.completed, each with a sequence_number).

`store` (the default, as OpenAI's) keeps each response's whole conversation, bounded per
tenant (the oldest dropped past ResponseStore.max_per_tenant), so `previous_response_id`
continues it server-side. A chain of responses is one session (core/sessions.py): its
calls send the chain's first response id as session_id unless the request names one,
so under sessions a follow-up finds its history's KV still pinned.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from sluice.entrypoints.openai.errors import APIError
from sluice.entrypoints.openai.protocol import _SamplingFields
from sluice.entrypoints.openai.tool_calls import StreamParser, ToolCall
from sluice.structured.params import StructuredOutputsParams


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: str = "text"
    name: str | None = None
    json_schema: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None


class ResponsesRequest(_SamplingFields):
    input: str | list[dict]
    instructions: str | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    max_output_tokens: int | None = None
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=128)
    metadata: dict[str, str] | None = None


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Stored:
    response: dict               # the response object as returned
    messages: list[dict]         # the conversation up to and including this response's output
    session_id: str              # its chain's session
    input_items: list[dict] = field(default_factory=list)  # its request's input, as items with ids


@dataclass
class ResponseStore:
    """Stored responses per tenant, the least recently stored dropped past the bound."""
    max_per_tenant: int = 1000
    _items: dict[str, OrderedDict] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, tenant: str, stored: Stored) -> None:
        with self._lock:
            items = self._items.setdefault(tenant, OrderedDict())
            items[stored.response["id"]] = stored
            while len(items) > self.max_per_tenant:
                items.popitem(last=False)

    def get(self, tenant: str, response_id: str) -> Stored | None:
        with self._lock:
            return self._items.get(tenant, {}).get(response_id)

    def delete(self, tenant: str, response_id: str) -> bool:
        with self._lock:
            return self._items.get(tenant, {}).pop(response_id, None) is not None


def input_messages(items, field_name: str = "input") -> list[dict]:
    """Responses input items -> chat messages (a string is one user message)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(items):
        where = f"{field_name}[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               param=field_name)
            out.append({"role": "system" if role == "developer" else role, "content": _text(item, where)})
        elif kind == "function_call":
            name, call_id, args = item.get("name"), item.get("call_id"), item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str) or not isinstance(args, str):
                raise APIError(400, f"{where}: a function_call needs string name, call_id and arguments",
                               param=field_name)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, (str, list)):
                raise APIError(400, f"{where}: a function_call_output needs a string call_id and output",
                               param=field_name)
            text = output if isinstance(output, str) else _text({"content": output}, where)
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        elif kind == "reasoning":
            continue  # an earlier turn's thinking, sent back: the history holds answers only
        else:
            raise APIError(400, f"{where}: unsupported input item type {kind!r} (message, function_call, "
                                f"function_call_output and reasoning are)", param=field_name)
    return out


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items_of(items) -> list[dict]:
    """A request's input as GET /v1/responses/{id}/input_items lists it: items with ids, a
    message's string content as one input_text part (already checked by input_messages)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    out = []
    for item in items:
        item = {"type": item.get("type", "message"), **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        item.setdefault("id", _id(_ITEM_PREFIX.get(item["type"], "item")))
        out.append(item)
    return out


def input_items_page(stored: Stored, limit: int, order: str, after: str | None) -> dict:
    """OpenAI's list shape, newest first by default (order=desc), `after` an item id."""
    if not 1 <= limit <= 100:
        raise APIError(400, f"limit must be in [1, 100], got {limit}", param="limit")
    if order not in ("asc", "desc"):
        raise APIError(400, f"order must be asc or desc, got {order!r}", param="order")
    items = stored.input_items if order == "asc" else stored.input_items[::-1]
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise APIError(400, f"after: no input item {after!r} in this response", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}


def _text(item: dict, where: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content[{j}]: only text parts (input_text, output_text) are supported",
                           param="input")
        texts.append(part["text"])
    return "".join(texts)


def text_format_spec(text: TextOptions | None) -> StructuredOutputsParams | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "text.format of type json_schema needs a schema", param="text")
        try:
            return StructuredOutputsParams(json=fmt.json_schema)
        except ValueError as e:
            raise APIError(400, str(e).replace("structured_outputs", "text.format", 1), param="text") from None
    raise APIError(400, f"text.format.type must be text, json_object or json_schema, got {fmt.type!r}",
                   param="text")


def output_items(content: str | None, calls: list[ToolCall], reasoning: str | None = None) -> list[dict]:
    items = [reasoning_item(_id("rs"), reasoning, "completed")] if reasoning else []
    if content:
        items.append(message_item(_id("msg"), content, "completed"))
    items.extend(call_item(c, "completed") for c in calls)
    return items


def message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A thinking model's reasoning (--reasoning-parser), as the Responses API's reasoning item."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def call_item(call: ToolCall, status: str, arguments: str | None = None) -> dict:
    return {"type": "function_call", "id": "fc_" + call.id.removeprefix("call_"), "call_id": call.id,
            "name": call.name, "arguments": call.arguments if arguments is None else arguments, "status": status}


def messages_of_output(items: list[dict]) -> list[dict]:
    """A response's output items as the chat messages its follow-up's history holds."""
    text = "".join(p["text"] for it in items if it["type"] == "message" for p in it["content"])
    calls = [{"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
             for it in items if it["type"] == "function_call"]
    msg = {"role": "assistant", "content": text}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


def response_object(rid: str, req: ResponsesRequest, model: str, status: str, output: list[dict],
                    usage: dict | None, incomplete: str | None = None) -> dict:
    return {
        "id": rid, "object": "response", "created_at": time.time(), "status": status, "model": model,
        "output": output, "error": None,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "instructions": req.instructions, "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
        "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
        "tools": req.tools or [], "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "text": {"format": (req.text.format.model_dump(by_alias=True, exclude_none=True)
                            if req.text and req.text.format else {"type": "text"})},
        "truncation": "disabled", "usage": usage, "user": req.user,
    }


def response_usage(prompt_tokens: int, output_tokens: int, cached: int, reasoning_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt_tokens + output_tokens}


def reasoning_tokens(token_ids, end_id: int | None) -> int:
    """Output tokens up to and including the thinking's end tag (all of them if it never closed)."""
    ids = list(token_ids)
    return ids.index(end_id) + 1 if end_id in ids else len(ids)


class Events:
    """The Responses stream: `event: TYPE` + `data: {...}` frames, numbered in order."""

    def __init__(self):
        self.seq = 0

    def __call__(self, kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class ResponsesServing:
    def __init__(self, serving, store: ResponseStore | None = None):
        self.serving = serving     # serving.OpenAIServing: tokenizer, engine, limits
        self.store = store or ResponseStore()

    async def create(self, req: ResponsesRequest, salt: str | None, tenant: str):
        from sluice.entrypoints.openai.serving import ChatTools, sampling_params, scheduling
        s = self.serving
        if req.n != 1:
            raise APIError(400, "the Responses API returns one output; n must be 1", param="n")
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise APIError(400, "max_output_tokens must be >= 1", param="max_output_tokens")
        deadline = s._deadline()
        history: list[dict] = []
        session_id = req.session_id
        if req.previous_response_id is not None:
            prev = self.store.get(tenant, req.previous_response_id)
            if prev is None:
                raise APIError(404, f"previous response {req.previous_response_id!r} not found (it was not stored, "
                                    f"or it was dropped)", param="previous_response_id",
                               code="previous_response_not_found")
            history = list(prev.messages)
            session_id = session_id or prev.session_id
        conversation = history + input_messages(req.input)
        messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
        if not messages:
            raise APIError(400, "input must not be empty", param="input")
        rid = _id("resp")
        if session_id is None and req.store:
            session_id = rid  # a chain's first response names its session (only a stored one has follow-ups)
        spec = text_format_spec(req.text)
        tools = ChatTools.of(req.tools, req.tool_choice, req.parallel_tool_calls)
        spec_field = "text"
        if tools.grammar is not None:
            if spec is not None:
                raise APIError(400, "tool_choice forces tool calls; it cannot be combined with text.format",
                               param="text")
            spec, spec_field = tools.grammar, "tool_choice"
        params = sampling_params(req, req.max_output_tokens, None, None, spec)
        await s._compile(spec, spec_field)
        prompt_ids = await s._off_loop(s._render_chat, messages, tools)
        sched = {**scheduling(req, tenant, s.model_name), "session_id": session_id}
        started = await s._start(rid, [prompt_ids], params, salt, deadline, req.stream, sched)
        if req.stream:
            return self._stream(rid, req, started, tools, conversation, session_id, tenant)
        (final,) = await s._finals(started)
        c = final.outputs[0]
        reasoning, answer = s.split_reasoning(c.text, started.prompt_ids[0])
        content, calls = tools.parse(answer)
        s.tools_called(started, [k.name for k in calls])
        output = output_items(content, calls, reasoning)
        incomplete = "max_output_tokens" if c.finish_reason == "length" else None
        thought = reasoning_tokens(c.token_ids, s.reasoning.end_id) if reasoning else 0
        resp = response_object(rid, req, req.model or s.model_name, "incomplete" if incomplete else "completed", output,
                               response_usage(len(started.prompt_ids[0]), len(c.token_ids),
                                              final.num_cached_tokens, thought), incomplete)
        self._keep(req, tenant, resp, conversation, session_id)
        return resp

    def _keep(self, req, tenant, resp, conversation, session_id) -> None:
        if req.store:
            self.store.put(tenant, Stored(resp, conversation + messages_of_output(resp["output"]), session_id,
                                          input_items_of(req.input)))

    async def _stream(self, rid, req, started, tools, conversation, session_id, tenant):
        from sluice.entrypoints.openai.serving import _ENGINE_ERRORS, _merge, api_error
        s = self.serving
        ev = Events()
        model = req.model or s.model_name
        yield ev("response.created", response=response_object(rid, req, model, "in_progress", [], None))
        yield ev("response.in_progress", response=response_object(rid, req, model, "in_progress", [], None))
        parser = StreamParser(tools.tools) if tools.active else None
        splitter = s.reasoning.splitter(started.prompt_ids[0]) if s.reasoning is not None else None
        output: list[dict] = []
        msg = None          # the open message item: (output index, id, text so far)
        thinking = None     # the open reasoning item: (output index, id, text so far)
        sent = 0
        try:
            async for _, out in _merge(started.streams):
                if out is None:
                    yield ": keep-alive\n\n"
                    continue
                c = out.outputs[0]
                delta = c.text[sent:]
                sent = len(c.text)
                thought = ""
                if splitter is not None:
                    thought, delta = splitter.feed(delta, final=c.finished)
                if thought:
                    if thinking is None:
                        thinking, events = self._open(ev, output, reasoning_item(_id("rs"), "", "in_progress"),
                                                      {"type": "reasoning_text", "text": ""})
                        for e in events:
                            yield e
                    thinking[2] += thought
                    yield ev("response.reasoning_text.delta", item_id=thinking[1], output_index=thinking[0],
                             content_index=0, delta=thought)
                if thinking is not None and (delta or c.finished or splitter.state == "answer"):
                    for e in self._close(ev, output, thinking, reasoning_item, "response.reasoning_text.done"):
                        yield e
                    thinking = None
                calls: list[ToolCall] = []
                if parser is not None:
                    delta, calls = parser.feed(delta, final=c.finished)
                if delta:
                    if msg is None:
                        msg, events = self._open(ev, output, message_item(_id("msg"), "", "in_progress"),
                                                 {"type": "output_text", "text": "", "annotations": []})
                        for e in events:
                            yield e
                    msg[2] += delta
                    yield ev("response.output_text.delta", item_id=msg[1], output_index=msg[0], content_index=0,
                             delta=delta, logprobs=[])
                if (calls or c.finished) and msg is not None:  # the message ends where a call starts
                    for e in self._close(ev, output, msg, message_item, "response.output_text.done", logprobs=[]):
                        yield e
                    msg = None
                for call in calls:
                    index = len(output)
                    item = call_item(call, "completed")
                    output.append(item)
                    yield ev("response.output_item.added", output_index=index, item=call_item(call, "in_progress", ""))
                    yield ev("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                             delta=call.arguments)
                    yield ev("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             arguments=call.arguments, name=call.name)
                    yield ev("response.output_item.done", output_index=index, item=item)
                if c.finished:
                    incomplete = "max_output_tokens" if c.finish_reason == "length" else None
                    thought = (reasoning_tokens(c.token_ids, s.reasoning.end_id)
                               if any(it["type"] == "reasoning" for it in output) else 0)
                    resp = response_object(rid, req, model, "incomplete" if incomplete else "completed", output,
                                           response_usage(len(started.prompt_ids[0]), len(c.token_ids),
                                                          out.num_cached_tokens, thought), incomplete)
                    s.tools_called(started, [it["name"] for it in output if it["type"] == "function_call"])
                    self._keep(req, tenant, resp, conversation, session_id)
                    yield ev("response.incomplete" if incomplete else "response.completed", response=resp)
        except _ENGINE_ERRORS as e:
            err = api_error(e)
            yield ev("error", code=err.code, message=err.message, param=None)
        finally:
            s._abort(started)

    @staticmethod
    def _open(ev, output, item, part) -> tuple[list, list[str]]:
        """A new in-progress output item: its [output index, id, text so far] and the two
        events that open it."""
        index = len(output)
        output.append(item)
        return [index, item["id"], ""], [
            ev("response.output_item.added", output_index=index, item={**item, "content": []}),
            ev("response.content_part.added", item_id=item["id"], output_index=index, content_index=0, part=part)]

    @staticmethod
    def _close(ev, output, state, make_item, text_done: str, **extra):
        """The events that complete an open item (make_item: message_item or reasoning_item)."""
        index, item_id, text = state
        output[index] = make_item(item_id, text, "completed")
        part = output[index]["content"][0]
        yield ev(text_done, item_id=item_id, output_index=index, content_index=0, text=text, **extra)
        yield ev("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
        yield ev("response.output_item.done", output_index=index, item=output[index])
