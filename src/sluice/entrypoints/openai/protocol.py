"""OpenAI wire format: pydantic models of requests and responses."""
from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from sluice.request import MAX_SESSION_ID_CHARS

# Deeper than this a JSON body is refused (400) before any field is read: nothing in the
# API nests more than a few levels, and deep values are costly to copy and to render.
MAX_BODY_DEPTH = 32


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def check_body(value) -> None:
    """ValueError for a body no tokenizer or template should see: a lone UTF-16
    surrogate in any string (JSON's "\\ud800" escapes parse to one, and the tokenizer
    fails on it) or nesting past MAX_BODY_DEPTH. Iterative, so depth costs no recursion."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        if depth > MAX_BODY_DEPTH:
            raise ValueError(f"the body nests deeper than {MAX_BODY_DEPTH} levels")
        if isinstance(v, str):
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    raise ValueError("a string in the body is not valid Unicode (a lone surrogate, "
                                     "such as \\ud800, has no UTF-8 form)") from None
        elif isinstance(v, dict):
            stack.extend((k, depth + 1) for k in v)
            stack.extend((x, depth + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, depth + 1) for x in v)


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: every chunk also carries its choice's usage so far (prompt + tokens sent).
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    # "schema" would shadow BaseModel.schema(): aliased.
    json_schema: dict | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (free), json_object (any JSON object) or json_schema."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _CheckedBody(BaseModel):
    """A request body that check_body() has seen before any field is parsed."""

    @model_validator(mode="before")
    @classmethod
    def _valid_text_and_depth(cls, data):
        check_body(data)
        return data


class _SamplingFields(_CheckedBody):
    # Unknown fields are ignored, as OpenAI's own server does, so clients that send
    # newer parameters keep working. NaN and Infinity (which Python's JSON parser
    # accepts) are refused in every float field.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # vLLM's: keep the stop string that ended the output at its end (default: cut before it).
    include_stop_str_in_output: bool = False
    # vLLM's: false shows the special tokens the model emits in the text.
    skip_special_tokens: StrictBool = True
    # OpenAI's {"<token id>": bias in [-100, 100]}; keys are token ids as JSON strings.
    logit_bias: dict[str, float] | None = None
    # vLLM's: sample only among these token ids.
    allowed_token_ids: list[int] | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: as many as the context holds).
    truncate_prompt_tokens: StrictInt | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Prefix-cache isolation: requests share cached blocks only with the same salt.
    cache_salt: str | None = None
    # vLLM extension: logprob and rank of each prompt token, plus the top k per position.
    prompt_logprobs: int | None = None
    # sluice's scheduling extensions (core/scheduler.py): the agent program this call
    # belongs to, whose KV stays pinned for its next call (namespaced by tenant), and a
    # priority, lower first under --scheduling-policy priority (vLLM's semantics).
    session_id: str | None = Field(default=None, min_length=1, max_length=MAX_SESSION_ID_CHARS)
    priority: StrictInt = Field(default=0, ge=0)
    # sluice extension: false = never speculative decoding for this request (where the
    # server runs it, --speculative-method); the output is the same, only its speed differs.
    speculative: StrictBool = True
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object
    # (json, json_object, regex, choice, grammar; sluice.structured.params) and vLLM's
    # older guided_* fields. At most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    # Accepted only as n (vLLM's V1 engine dropped best_of > n as well).
    best_of: int | None = None
    # OpenAI's insertion suffix: refused (no fill-in-the-middle here), as vLLM does.
    suffix: str | None = None
    # vLLM's: each choice also carries prompt_token_ids and the output's token_ids (in a
    # stream: the prompt's in a choice's first chunk, each chunk's new tokens), as RL
    # trainers read them.
    return_token_ids: StrictBool = False


class ChatMessage(BaseModel):
    # Other fields (name, tool_calls, tool_call_id, ...) reach the chat template as sent.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    role: str
    content: str | list[dict] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: continue the last (assistant) message rather than open a new turn, and extra
    # variables for the chat template (e.g. {"enable_thinking": false} for Qwen3).
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    # vLLM's: prompt_token_ids (the rendered conversation's) and each choice's token_ids.
    return_token_ids: StrictBool = False
    # Function tools (entrypoints/openai/tool_calls.py): checked there, field by field.
    tools: list | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_CheckedBody):
    """vLLM's POST /tokenize: a prompt (as /v1/completions tokenizes it) or messages (as
    /v1/chat/completions renders them), exactly one."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: True for a prompt, False for messages (the rendered template holds its own).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict | None = None
    tools: list | None = None
    return_token_strs: StrictBool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's shape: None for the first prompt token, then per token {token id: PromptLogprob}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    # return_token_ids (vLLM's extension)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    # sluice extension: the weights that computed it (a count of updates, or the
    # weight_version a trainer gave its update: POST /v1/weights/update).
    weight_version: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    # A thinking model's reasoning, apart from the answer (--reasoning-parser; vLLM's field).
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    # sluice extension: the weights that computed it (a count of updates, or the
    # weight_version a trainer gave its update: POST /v1/weights/update).
    weight_version: str | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in a choice's first chunk
    prompt_logprobs: PromptLogprobs | None = None  # in a choice's first chunk, as the response has them
    # sluice extension: the weights that computed it (a count of updates, or the
    # weight_version a trainer gave its update: POST /v1/weights/update).
    weight_version: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sluice"
    # vLLM's: what the model was loaded from, and for a LoRA adapter the base model's id.
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
