"""Hypothesis over what users send: any value for any SamplingParams field, and any JSON
for the server's request models, is either accepted within bounds the engine can run or
refused with ValueError / a 4xx (never another exception)."""
from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from sluice.entrypoints.openai.errors import APIError
from sluice.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sluice.entrypoints.openai.serving import chat_message, normalize_prompts, sampling_params
from sluice.sampling_params import INT32_MAX, SamplingParams

FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]
ANY = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-2, max_value=64), st.sampled_from([2**31, 2**63, 2**64, -2**63 - 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(min_value=-3, max_value=3),
    st.text(max_size=4), st.lists(st.integers(), max_size=3), st.lists(st.text(max_size=3), max_size=3),
    st.dictionaries(st.text(max_size=2), st.integers(), max_size=2),
    st.dictionaries(st.integers(min_value=-2, max_value=2**32), st.floats(allow_nan=True), max_size=2))


@settings(max_examples=600, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=6))
def test_sampling_params_accept_within_bounds_or_raise_value_error(kwargs):
    try:
        p = SamplingParams(**kwargs)
    except ValueError:
        return
    for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        assert not isinstance(value, bool) and math.isfinite(value), (name, value)
    assert p.temperature == 0 or p.temperature >= 1e-2
    for name in ("n", "top_k", "min_tokens"):
        value = getattr(p, name)
        assert type(value) is int and -1 <= value <= INT32_MAX, (name, value)
    for name in ("max_tokens", "logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        assert value is None or (type(value) is int and 0 <= value <= INT32_MAX), (name, value)
    assert p.seed is None or -2**63 <= p.seed < 2**64
    assert all(type(s) is str and s for s in p.stop) and len(p.stop) <= 64
    assert all(type(t) is int and 0 <= t <= INT32_MAX for t in p.stop_token_ids)
    assert isinstance(p.ignore_eos, bool)
    assert p.logit_bias is None or all(type(t) is int and 0 <= t <= INT32_MAX and -100 <= b <= 100
                                       for t, b in p.logit_bias.items())


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                    max_leaves=12)
SAMPLING_KEYS = ["n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens", "stream",
                 "stream_options", "prompt_logprobs", "max_tokens", "logprobs", "echo", "best_of", "logit_bias",
                 "allowed_token_ids"]


def body_of(extra_keys):
    known = st.fixed_dictionaries({}, optional={k: JSON | ANY for k in SAMPLING_KEYS + extra_keys})
    return st.tuples(known, st.dictionaries(st.text(max_size=5), JSON, max_size=2)).map(
        lambda kv: {**kv[1], **kv[0]})


def to_params(req, max_tokens, logprobs):
    try:
        return sampling_params(req, max_tokens, logprobs if isinstance(logprobs, int) else None)
    except APIError as e:
        assert 400 <= e.status < 500
        return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body_of(["prompt"]))
def test_completion_bodies_validate_or_are_4xx(body):
    try:
        req = CompletionRequest.model_validate(body)
    except ValidationError:
        return
    try:
        normalize_prompts(req.prompt)
    except APIError as e:
        assert e.status == 400
    to_params(req, req.max_tokens, req.logprobs)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body_of(["messages", "max_completion_tokens", "top_logprobs"]),
       st.lists(st.fixed_dictionaries({"role": JSON, "content": JSON}, optional={"name": JSON}), max_size=3))
def test_chat_bodies_validate_or_are_4xx(body, messages):
    body.setdefault("messages", messages)
    try:
        req = ChatCompletionRequest.model_validate(body)
    except ValidationError:
        return
    for i, m in enumerate(req.messages):
        try:
            msg = chat_message(m, i)
            assert isinstance(msg["content"], str) and isinstance(msg["role"], str)
        except APIError as e:
            assert e.status == 400
    to_params(req, req.max_tokens, req.top_logprobs)
