"""Completions and chat completions: OpenAI requests -> engine requests -> OpenAI responses.

Streaming responses are Server-Sent Events. Every engine request a handler starts is
aborted in a `finally`, so a client that disconnects (the response task is cancelled)
frees its KV blocks within one engine step; aborting a finished request is a no-op.

Prompts are tokenized (and chat templates rendered) on a small thread pool, never on the
event loop or the engine thread: the tokenizer releases the GIL, so a huge prompt delays
nobody else's stream. Admission counts sequences (prompts x n) against
ServingLimits.max_waiting in the same synchronous stretch that hands them to the engine,
so simultaneous requests cannot all pass the check before any is counted. Every request
has a deadline (ServingLimits.request_timeout); a stream that has nothing to send gets an
SSE comment every sse_keepalive_s, and a stream that fails ends with an error event and
`[DONE]`, never by a cut connection.
"""
from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import AsyncIterator

import jinja2

from sluice.engine.async_engine import (AsyncEngine, EngineDeadError, QueueTimeoutError, RequestFailedError,
                                        RequestTimeoutError, ShuttingDownError)
from sluice.engine.llm_engine import EngineAsleepError
from sluice.entrypoints.openai import tool_calls
from sluice.entrypoints.openai.errors import APIError, error_payload, from_value_error
from sluice.entrypoints.openai.protocol import (
    ChatChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatLogprobs,
    ChatResponseMessage, ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, DeltaMessage, DetokenizeRequest, PromptLogprob, PromptTokensDetails,
    TokenizeRequest, TopLogprob, UsageInfo, random_id)
from sluice.entrypoints.openai.quotas import NeverFits, RateLimited, RateLimiter, Ticket
from sluice.outputs import RequestOutput
from sluice.request import Logprob
from sluice.sampling_params import SamplingParams
from sluice.structured.params import StructuredOutputsParams


@dataclass
class ServingLimits:
    # Sequences (prompts x n) allowed to wait for a seat; past it, 429 + Retry-After.
    max_waiting: int = 128
    # The most samples one request may ask for (n, best_of).
    max_n: int = 16
    # Seconds a request may wait and run in all; None: no limit.
    request_timeout: float | None = 600.0
    # Seconds of silence after which a stream gets an SSE comment (proxies and clients
    # that time out idle connections would otherwise drop a queued stream).
    sse_keepalive_s: float = 15.0
    # Seconds a request may wait for its first step; past it, it is dropped and answered
    # 429 with a Retry-After from the drain rate (an error event on a stream). None: no bound.
    max_queue_wait: float | None = None


def api_error(e: BaseException) -> APIError | None:
    """The HTTP error for a request the engine could not finish; None if `e` is not one."""
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="engine_error")
    if isinstance(e, ShuttingDownError):
        return APIError(503, str(e), code="shutting_down", headers={"Retry-After": "5"})
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable", headers={"Retry-After": "5"})
    if isinstance(e, RequestTimeoutError):
        return APIError(504, str(e), code="timeout")
    if isinstance(e, QueueTimeoutError):
        return APIError(429, str(e), code="queue_timeout", headers={"Retry-After": str(e.retry_after)})
    if isinstance(e, EngineAsleepError):
        return APIError(503, str(e), code="engine_asleep", headers={"Retry-After": "5"})
    return None


_ENGINE_ERRORS = (RequestFailedError, ShuttingDownError, EngineDeadError, RequestTimeoutError, EngineAsleepError,
                  QueueTimeoutError)


def sse_error(e: APIError) -> str:
    body = error_payload(e.status, e.message)
    body["error"]["code"] = e.code
    return f"data: {json.dumps(body)}\n\n"


def structured_outputs(req) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field it came from: response_format,
    structured_outputs or one of vLLM's guided_* fields (at most one of them)."""
    given: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif rf.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs a json_schema object",
                           param="response_format")
        else:
            given.append(("response_format", {"json": rf.json_schema.json_schema}))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            given.append((f"guided_{kind}", {kind: value}))
    if not given:
        return None, None
    if len(given) > 1:
        raise APIError(400, f"give at most one of response_format, structured_outputs and guided_*; got "
                            f"{', '.join(f for f, _ in given)}", param=given[1][0])
    field, value = given[0]
    try:
        return StructuredOutputsParams.from_dict(value, field), field
    except ValueError as e:
        raise APIError(400, str(e).replace("structured_outputs", field, 1), param=field) from None


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise APIError(400, f"logit_bias keys must be token ids (decimal integers), got {key!r}",
                           param="logit_bias")
        out[int(key)] = value
    return out


def sampling_params(req, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None = None,
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    kwargs = dict(n=req.n, max_tokens=max_tokens, seed=req.seed, ignore_eos=req.ignore_eos,
                  min_tokens=req.min_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                  stop=req.stop or [], stop_token_ids=req.stop_token_ids or [],
                  include_stop_str_in_output=req.include_stop_str_in_output,
                  skip_special_tokens=req.skip_special_tokens,
                  structured_outputs=structured, speculative=getattr(req, "speculative", True))
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias is not None:
        kwargs["logit_bias"] = logit_bias_ids(req.logit_bias)
    if req.allowed_token_ids is not None:
        kwargs["allowed_token_ids"] = req.allowed_token_ids
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise from_value_error(e) from None


def check_prompt_logprobs(req) -> int | None:
    """As vLLM: in [0, 20] (20 as for logprobs). Streamed too: a choice's first chunk
    carries them (the prompt is complete before its first token)."""
    k = req.prompt_logprobs
    if k is not None and not 0 <= k <= 20:
        raise APIError(400, f"prompt_logprobs must be in [0, 20], got {k}", param="prompt_logprobs")
    return k


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None] | None, prompt_ids: list[int],
                         k: int) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's prompt_logprobs: None first, then per prompt token {token id: logprob, rank,
    decoded token} with the prompt token and the top k."""
    if entries is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for tid, entry in zip(prompt_ids, entries):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
                    for t, lp in entry.items() if t == tid or lp.rank <= k})
    return out


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"   # an SSE comment: clients ignore it, idle timers reset


def sse(payload) -> str:
    data = payload.model_dump()
    for choice in data.get("choices", ()):
        if "delta" in choice:  # as OpenAI does: a delta carries only the fields it sets
            choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class _Started:
    request_ids: list[str]
    prompt_ids: list[list[int]]
    streams: list[AsyncIterator[RequestOutput]]
    # Its tenant's rate limits (quotas.py): the admission ticket, and each prompt's output
    # tokens so far (charged when the request ends).
    ticket: Ticket | None = None
    output_tokens: list[int] = field(default_factory=list)
    # (session_id, tenant) of a call in a session, else None.
    session: tuple[str, str] | None = None


@dataclass
class _Progress:
    """What one choice has sent so far."""
    text_len: int = 0
    tokens: int = 0
    echo_len: int = 0   # characters of echoed prompt before the completion text
    sent_role: bool = False
    sent_prompt_logprobs: bool = False
    done: bool = False


def _complete(prompt_logprobs) -> bool:
    """Every prompt position scored (the one sample of n that scores the prompt may
    still be computing it when another sends its first token)."""
    return prompt_logprobs is not None and all(e is not None for e in prompt_logprobs[1:])


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, model_name: str, limits: ServingLimits | None = None,
                 quotas: RateLimiter | None = None):
        self.engine = engine
        self.model_name = model_name
        self.limits = limits or ServingLimits()
        # Tenants' rate limits (quotas.py); None: none.
        self.quotas = quotas
        self.tokenizer = engine.engine.tokenizer
        # --reasoning-parser: a thinking model's format (sluice/reasoning.py), else None.
        self.reasoning = getattr(engine.engine, "reasoning", None)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="sluice-tokenize")
        self._tokenizer_info: dict | None = None

    def _deadline(self) -> float | None:
        t = self.limits.request_timeout
        return None if t is None else asyncio.get_running_loop().time() + t

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _check_n(self, n: int, best_of: int | None = None) -> None:
        if n > self.limits.max_n:
            raise APIError(400, f"n must be at most {self.limits.max_n} on this server, got {n}", param="n")
        if best_of is not None and best_of != n:
            raise APIError(400, f"best_of must equal n ({n}) if given, got {best_of}: sampling more candidates "
                                f"than are returned is not supported", param="best_of")

    def _admit(self, num_seqs: int) -> None:
        """429 when this request's sequences would take the queue past max_waiting; 400 when
        they could never fit it; 503 while the server stops. Synchronous, and followed by
        the engine submission without an await in between."""
        limit = self.limits.max_waiting
        if not self.engine.accepting:
            raise (ShuttingDownError("the server is shutting down") if not self.engine.dead
                   else EngineDeadError("the engine stopped; the server is restarting"))
        if num_seqs > limit:
            raise APIError(400, f"this request has {num_seqs} sequences (prompts x n), more than this server "
                                f"queues at once ({limit}, --max-waiting)", param="n")
        waiting = self.engine.num_waiting_seqs
        if waiting + num_seqs > limit:
            raise APIError(429, f"server overloaded: {waiting} sequences waiting, and this request adds "
                                f"{num_seqs} (max_waiting={limit}); retry later",
                           code="overloaded", headers={"Retry-After": "1"})

    def tools_called(self, started: _Started, names: list[str]) -> None:
        """A session's call ended by calling these tools: tell the engine, whose pin of the
        session's KV then lasts as long as they have taken before (core/sessions.py)."""
        if started.session is not None and names:
            self.engine.note_tool_calls(started.session[0], names, started.session[1])

    async def _start(self, base_id: str, prompts: list[list[int]], params: SamplingParams,
                     salt: str | None, deadline: float | None, stream: bool,
                     scheduling: dict | None = None) -> _Started:
        # All prompts are handed to the engine at once (it takes commands between steps,
        # so adding them one after another would cost a step each).
        tenant = (scheduling or {}).get("tenant", "")
        quota = self.quotas.limits(tenant) if self.quotas is not None else None
        if quota is not None and quota.max_tokens is not None:
            params = self._capped(params, prompts, quota.max_tokens, tenant)
        # What the model can tell is wrong with the request first: a bad request is a 400
        # whatever the load or the tenant's quota (the engine checks again as it adds it).
        try:
            for p in prompts:
                self.engine.engine.check_request(p, params, (scheduling or {}).get("lora"))
        except ValueError as e:
            raise from_value_error(e) from None
        self._admit(len(prompts) * params.n)
        ticket = None
        if quota is not None:  # synchronous, as _admit: nothing runs between them and the submission
            try:
                ticket = self.quotas.admit(tenant, sum(map(len, prompts)),
                                           len(prompts) * params.n * (params.max_tokens or 0))
            except RateLimited as e:
                raise APIError(429, str(e), code="rate_limit_exceeded", headers=e.headers) from None
            except NeverFits as e:
                raise APIError(400, str(e), param="max_tokens", code="rate_limit_exceeded") from None
        rids = [f"{base_id}-{i}" for i in range(len(prompts))]
        started = _Started(rids, [], [], ticket, [0] * len(prompts))
        if (scheduling or {}).get("session_id") is not None:
            started.session = (scheduling["session_id"], tenant)
        futures = []
        try:
            for i, (rid, p) in enumerate(zip(rids, prompts)):
                added, outputs = self.engine.submit(rid, p, params, cache_salt=salt, deadline=deadline,
                                                    keepalive_s=self.limits.sse_keepalive_s if stream else None,
                                                    scheduling=scheduling, queue_wait_s=self.limits.max_queue_wait)
                futures.append(added)
                started.streams.append(outputs if ticket is None else _counted(outputs, started, i))
            results = await asyncio.gather(*futures, return_exceptions=True)
        except BaseException:
            self._abort(started)
            raise
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            if ticket is not None:  # a request the engine refused costs no quota
                self.quotas.cancel(ticket)
            self._abort(started)  # aborting a request that was never added is a no-op
            if isinstance(errors[0], ValueError):
                raise from_value_error(errors[0]) from None
            raise errors[0]
        started.prompt_ids.extend(results)
        return started

    async def _finals(self, started: _Started) -> list[RequestOutput]:
        try:
            return await _gather_finals(started.streams)
        finally:
            self._abort(started)

    async def _tokenize_prompts(self, prompts: list) -> list[list[int]]:
        texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
        if not texts:
            return prompts
        encoded = await self._off_loop(lambda: [self.tokenizer.encode(prompts[i]) if prompts[i] else []
                                                for i in texts])
        out = list(prompts)
        for i, ids in zip(texts, encoded):
            out[i] = ids
        return out

    def _truncate(self, req, ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: the prompt's last k tokens (-1: the context's
        length), so that a client can send more history than fits and keep its end."""
        k = req.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = self.engine.engine.max_model_len
        if k < 1:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or >= 1, got {req.truncate_prompt_tokens}",
                           param="truncate_prompt_tokens")
        return ids[-k:]

    async def _compile(self, spec: StructuredOutputsParams | None, field: str | None) -> None:
        """Compile the request's grammar off the event loop and the engine thread, within
        the compile time limit; a grammar llguidance refuses is a 400 naming the field."""
        if spec is None:
            return
        try:
            await self.engine.engine.grammars.compile_async(spec)
        except ValueError as e:
            raise APIError(400, str(e).replace("structured_outputs", field, 1), param=field) from None

    def _abort(self, started: _Started) -> None:
        """A request's end, whatever ended it: abort what still runs, and settle its
        tenant's quota (its output tokens charged, its concurrency slot freed)."""
        for rid in started.request_ids:
            self.engine.abort(rid)
        t = started.ticket
        if t is not None and not t.released:
            self.quotas.charge(t.tenant, sum(started.output_tokens))
            self.quotas.release(t)

    def _capped(self, params: SamplingParams, prompts: list[list[int]], cap: int, tenant: str) -> SamplingParams:
        """The tenant's max_tokens: a request asking for more is a 400; one asking for none
        gets the cap (or what the context leaves, if less)."""
        if params.max_tokens is not None:
            if params.max_tokens > cap:
                raise APIError(400, f"max_tokens {params.max_tokens} is above tenant {tenant!r}'s limit of {cap}",
                               param="max_tokens", code="rate_limit_exceeded")
            return params
        room = self.engine.engine.max_model_len - max(map(len, prompts))
        return params.clone(max_tokens=min(cap, room)) if room > 0 else params

    # -- completions ----------------------------------------------------------
    async def completions(self, req: CompletionRequest, salt: str | None = None, tenant: str = ""):
        deadline = self._deadline()
        prompts = normalize_prompts(req.prompt)
        if req.logprobs is not None and not 0 <= req.logprobs <= 20:
            raise APIError(400, f"logprobs must be in [0, 20], got {req.logprobs}", param="logprobs")
        self._check_n(req.n, req.best_of)
        if req.suffix:
            raise APIError(400, "suffix (fill-in-the-middle) is not supported", param="suffix")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens 0 generates nothing: it is valid only with echo=true, which returns "
                                "the prompt (with its logprobs, if asked) as the completion", param="max_tokens")
        prompt_lp = check_prompt_logprobs(req)
        if req.echo and req.logprobs is not None and (prompt_lp is None or prompt_lp < req.logprobs):
            prompt_lp = req.logprobs  # echoed prompt tokens get their real logprobs
        spec, spec_field = structured_outputs(req)
        params = sampling_params(req, req.max_tokens, req.logprobs, prompt_lp, spec)
        await self._compile(spec, spec_field)
        cid = random_id("cmpl")
        prompt_ids = [self._truncate(req, ids) for ids in await self._tokenize_prompts(prompts)]
        started = await self._start(cid, prompt_ids, params, salt, deadline, req.stream,
                                    scheduling(req, tenant, self.model_name))
        if req.stream:
            return self._completion_stream(cid, req, started, params.n)
        finals = await self._finals(started)
        choices, completion_tokens = [], 0
        for pi, (out, ids) in enumerate(zip(finals, started.prompt_ids)):
            prefix = self._prompt_text(prompts[pi], ids, req.truncate_prompt_tokens is not None) if req.echo else ""
            prompt_lps = (prompt_logprobs_json(out.prompt_logprobs, ids, req.prompt_logprobs)
                          if req.prompt_logprobs is not None else None)
            echo_lps = (self._completion_logprobs(out.prompt_logprobs, ids, 0, 0, req.logprobs)
                        if req.echo and req.logprobs is not None else None)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                lp = None
                if req.logprobs is not None:
                    lp = self._completion_logprobs(c.logprobs, c.token_ids, len(prefix), 0, req.logprobs)
                    if echo_lps is not None:
                        lp = _concat_logprobs(echo_lps, lp)
                choices.append(CompletionChoice(
                    index=pi * params.n + c.index, text=prefix + c.text, logprobs=lp,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason, prompt_logprobs=prompt_lps,
                    **(dict(prompt_token_ids=list(ids), token_ids=list(c.token_ids)) if req.return_token_ids else {})))
        prompt_tokens = sum(len(ids) for ids in started.prompt_ids)
        return CompletionResponse(id=cid, model=req.model or self.model_name, choices=choices,
                                  usage=usage(prompt_tokens, completion_tokens,
                                              sum(f.num_cached_tokens for f in finals)),
                                  weight_version=finals[-1].weight_version)

    async def _completion_stream(self, cid: str, req: CompletionRequest, started: _Started, n: int):
        progress: dict[int, _Progress] = {}
        completion_tokens = 0
        cached: dict[int, int] = {}
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        try:
            async for pi, out in _merge(started.streams):
                if out is None:
                    yield KEEPALIVE
                    continue
                cached[pi] = out.num_cached_tokens
                for c in out.outputs:
                    index = pi * n + c.index
                    p = progress.setdefault(index, _Progress())
                    if p.done:
                        continue
                    prefix = ""
                    first_chunk = not p.sent_role
                    echo = req.echo and first_chunk
                    if echo:
                        prefix = self._prompt_text(normalize_prompts(req.prompt)[pi], started.prompt_ids[pi],
                                                   req.truncate_prompt_tokens is not None)
                        p.echo_len = len(prefix)
                    p.sent_role = True
                    delta = prefix + c.text[p.text_len:]
                    new_tokens = c.token_ids[p.tokens:]
                    if not delta and not c.finished and not new_tokens:
                        continue
                    lp = None
                    if req.logprobs is not None and (new_tokens or echo):  # (max_tokens 0: the echo alone)
                        lp = self._completion_logprobs((c.logprobs or [])[p.tokens:], new_tokens, 0,
                                                       p.echo_len + p.text_len, req.logprobs)
                        if echo:
                            lp = _concat_logprobs(self._completion_logprobs(
                                out.prompt_logprobs, started.prompt_ids[pi], 0, 0, req.logprobs), lp)
                    p.text_len, p.tokens = len(c.text), len(c.token_ids)
                    if c.finished:
                        p.done = True
                        completion_tokens += len(c.token_ids)
                    ids = {}
                    if req.return_token_ids:
                        ids = dict(token_ids=list(new_tokens),
                                   prompt_token_ids=list(started.prompt_ids[pi]) if first_chunk else None)
                    so_far = (usage(len(started.prompt_ids[pi]), len(c.token_ids), out.num_cached_tokens)
                              if continuous else None)
                    plp = None
                    if req.prompt_logprobs is not None and not p.sent_prompt_logprobs \
                            and (c.finished or _complete(out.prompt_logprobs)):
                        p.sent_prompt_logprobs = True
                        plp = prompt_logprobs_json(out.prompt_logprobs, started.prompt_ids[pi], req.prompt_logprobs)
                    chunk = CompletionResponse(id=cid, model=req.model or self.model_name, choices=[CompletionChoice(
                        index=index, text=delta, logprobs=lp, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason, prompt_logprobs=plp, **ids)],
                        weight_version=out.weight_version, usage=so_far)
                    yield sse(chunk)
            if req.stream_options and req.stream_options.include_usage:
                prompt_tokens = sum(len(ids) for ids in started.prompt_ids)
                yield sse(CompletionResponse(id=cid, model=req.model or self.model_name, choices=[],
                                             usage=usage(prompt_tokens, completion_tokens, sum(cached.values()))))
            yield DONE
        except _ENGINE_ERRORS as e:
            yield sse_error(api_error(e))
            yield DONE
        finally:
            self._abort(started)

    def _prompt_text(self, prompt, ids: list[int], truncated: bool = False) -> str:
        """The prompt as echo shows it: as sent, or its ids decoded (token ids sent, or a
        prompt cut by truncate_prompt_tokens)."""
        return prompt if isinstance(prompt, str) and not truncated else self.tokenizer.decode(ids)

    def _completion_logprobs(self, entries, token_ids, text_start: int, offset: int,
                             top_n: int) -> CompletionLogprobs:
        out = CompletionLogprobs()
        pos = offset + text_start
        # Prompt logprobs (echo) have None for the first token: no logprob, no top.
        for tid, entry in zip(token_ids, entries or []):
            chosen = entry.get(tid) if entry is not None else None
            tok = chosen.decoded_token if chosen else self.tokenizer.token_text(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(chosen.logprob if chosen else None)
            if entry is None:
                out.top_logprobs.append(None)
            else:
                tops = sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]
                out.top_logprobs.append({lp.decoded_token: lp.logprob for lp in tops})
            out.text_offset.append(pos)
            pos += len(tok)
        return out

    # -- tokenizer routes -----------------------------------------------------
    async def tokenize(self, req: TokenizeRequest, max_model_len: int) -> dict:
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            ids = await self._off_loop(lambda: self.tokenizer.encode(req.prompt, add_special_tokens=add_special))
        else:
            messages = [chat_message(m, i) for i, m in enumerate(req.messages)]
            if not messages:
                raise APIError(400, "messages must not be empty", param="messages")
            tools = ChatTools.of(req.tools, None, True)
            ids = await self._off_loop(self._render_chat, messages, tools, req.add_generation_prompt,
                                       req.continue_final_message, req.chat_template_kwargs,
                                       bool(req.add_special_tokens))
        strs = self.tokenizer.hf.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}

    def tokenizer_info(self, max_model_len: int) -> dict:
        if self._tokenizer_info is None:  # fixed for the server's life
            self._tokenizer_info = self.tokenizer.info(max_model_len)
        return self._tokenizer_info

    async def detokenize(self, req: DetokenizeRequest, vocab_size: int) -> dict:
        if any(not 0 <= t < vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {vocab_size})", param="tokens")
        text = await self._off_loop(lambda: self.tokenizer.decode(req.tokens, skip_special_tokens=False))
        return {"prompt": text}

    # -- chat -----------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, salt: str | None = None, tenant: str = ""):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        deadline = self._deadline()
        prompt_lp = check_prompt_logprobs(req)
        self._check_n(req.n)
        messages = [chat_message(m, i) for i, m in enumerate(req.messages)]
        if not messages:
            raise APIError(400, "messages must not be empty", param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if max_tokens == 0:
            field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
            raise APIError(400, f"{field} must be at least 1 (to score a prompt without generating, use "
                                f"/v1/completions with echo=true and max_tokens 0)", param=field)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        spec, spec_field = structured_outputs(req)
        tools = ChatTools.of(req.tools, req.tool_choice, req.parallel_tool_calls)
        if tools.grammar is not None:
            if spec is not None:
                raise APIError(400, f"tool_choice {req.tool_choice!r} constrains the output to tool calls; it "
                                    f"cannot be combined with {spec_field}", param=spec_field)
            spec, spec_field = tools.grammar, "tool_choice"
        params = sampling_params(req, max_tokens, logprobs, prompt_lp, spec)
        await self._compile(spec, spec_field)
        prompt_ids = self._truncate(req, await self._off_loop(
            self._render_chat, messages, tools, req.add_generation_prompt, req.continue_final_message,
            req.chat_template_kwargs))
        cid = random_id("chatcmpl")
        started = await self._start(cid, [prompt_ids], params, salt, deadline, req.stream, scheduling(req, tenant, self.model_name))
        if req.stream:
            return self._chat_stream(cid, req, started, tools)
        (final,) = await self._finals(started)
        choices = []
        for c in final.outputs:
            reasoning, answer = self.split_reasoning(c.text, started.prompt_ids[0])
            content, calls = tools.parse(answer)
            if reasoning is not None and not content:
                content = None  # all of it was thinking
            finish = "tool_calls" if calls and c.finish_reason == "stop" else c.finish_reason
            self.tools_called(started, [k.name for k in calls])
            choices.append(ChatChoice(
                index=c.index, message=ChatResponseMessage(content=content, reasoning_content=reasoning,
                                                           tool_calls=[k.as_openai() for k in calls] or None),
                logprobs=self._chat_logprobs(c.logprobs, c.token_ids, req.top_logprobs or 0) if req.logprobs else None,
                finish_reason=finish, stop_reason=c.stop_reason,
                token_ids=list(c.token_ids) if req.return_token_ids else None))
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        prompt_tokens = len(started.prompt_ids[0])
        prompt_lps = (prompt_logprobs_json(final.prompt_logprobs, started.prompt_ids[0], req.prompt_logprobs)
                      if req.prompt_logprobs is not None else None)
        return ChatCompletionResponse(id=cid, model=req.model or self.model_name, choices=choices,
                                      usage=usage(prompt_tokens, completion_tokens, final.num_cached_tokens),
                                      prompt_logprobs=prompt_lps, weight_version=final.weight_version,
                                      prompt_token_ids=list(started.prompt_ids[0]) if req.return_token_ids else None)

    def split_reasoning(self, text: str, prompt_ids: list[int]) -> tuple[str | None, str]:
        """(reasoning, answer) of a whole output: no reasoning without --reasoning-parser."""
        if self.reasoning is None:
            return None, text
        reasoning, answer = self.reasoning.split(text, prompt_ids)
        return reasoning, answer or ""

    def _render_chat(self, messages: list[dict], tools: "ChatTools | None" = None,
                     add_generation_prompt: bool = True, continue_final_message: bool = False,
                     chat_template_kwargs: dict | None = None, add_special_tokens: bool = False) -> list[int]:
        template_tools = None
        if tools is not None:
            messages, template_tools = tools.render(messages, self.tokenizer.chat_template)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tools=template_tools,
                continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs)
        except ValueError as e:
            msg = str(e)
            param = next((f for f in ("continue_final_message", "chat_template_kwargs") if msg.startswith(f)),
                         "messages")
            raise APIError(400, msg, param=param) from None
        except jinja2.TemplateError as e:  # the template's own refusal (raise_exception) or syntax
            raise APIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        except Exception:  # a template that breaks on this conversation's shape
            raise APIError(400, "the model's chat template could not render these messages", param="messages") \
                from None
        # (The rendered template holds its special tokens; /tokenize may ask for the
        # tokenizer's own on top, as vLLM's does.)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    async def _chat_stream(self, cid: str, req: ChatCompletionRequest, started: _Started, tools: "ChatTools"):
        progress: dict[int, _Progress] = {}
        parsers: dict[int, tool_calls.StreamParser] = {}
        splitters = {}  # per choice, with --reasoning-parser: its reasoning apart from its answer
        completion_tokens = 0
        top_n = req.top_logprobs or 0
        cached = 0
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        so_far: UsageInfo | None = None  # continuous_usage_stats: the current choice's

        def emit(out: RequestOutput, choice: ChatStreamChoice, prompt_token_ids: list[int] | None = None,
                 prompt_logprobs=None) -> str:
            return sse(ChatCompletionChunk(id=cid, model=req.model or self.model_name, choices=[choice],
                                           weight_version=out.weight_version, prompt_token_ids=prompt_token_ids,
                                           prompt_logprobs=prompt_logprobs, usage=so_far))
        try:
            async for _, out in _merge(started.streams):
                if out is None:
                    yield KEEPALIVE
                    continue
                cached = out.num_cached_tokens
                for c in out.outputs:
                    p = progress.setdefault(c.index, _Progress())
                    if p.done:
                        continue
                    if continuous:
                        so_far = usage(len(started.prompt_ids[0]), len(c.token_ids), out.num_cached_tokens)
                    plp = None  # the prompt's logprobs: with the role, or once complete
                    if req.prompt_logprobs is not None and not p.sent_prompt_logprobs \
                            and (c.finished or _complete(out.prompt_logprobs)):
                        p.sent_prompt_logprobs = True
                        plp = prompt_logprobs_json(out.prompt_logprobs, started.prompt_ids[0], req.prompt_logprobs)
                    if not p.sent_role:
                        p.sent_role = True
                        yield emit(out, ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(role="assistant", content="")),
                            list(started.prompt_ids[0]) if req.return_token_ids else None, plp)
                    elif plp is not None:
                        yield emit(out, ChatStreamChoice(index=c.index, delta=DeltaMessage()), prompt_logprobs=plp)
                    delta = c.text[p.text_len:]
                    new_tokens = c.token_ids[p.tokens:]
                    lp = None
                    if req.logprobs and new_tokens:
                        lp = self._chat_logprobs(c.logprobs[p.tokens:], new_tokens, top_n)
                    p.text_len, p.tokens = len(c.text), len(c.token_ids)
                    thought = ""
                    if self.reasoning is not None:  # the thinking first, as its own deltas
                        splitter = splitters.get(c.index)
                        if splitter is None:
                            splitter = splitters[c.index] = self.reasoning.splitter(started.prompt_ids[0])
                        thought, delta = splitter.feed(delta, final=c.finished)
                    calls = []
                    if tools.active:  # content until a <tool_call> begins; each call once it closes
                        parser = parsers.setdefault(c.index, tools.stream_parser())
                        delta, calls = parser.feed(delta, final=c.finished)
                    # (return_token_ids: every new token is sent, also while a tool call's
                    # text is held back by the parser.)
                    if thought:
                        yield emit(out, ChatStreamChoice(index=c.index, delta=DeltaMessage(reasoning_content=thought),
                                                         logprobs=None if delta else lp,
                                                         token_ids=None if delta or not req.return_token_ids
                                                         else list(new_tokens)))
                    if delta or (not thought and (lp is not None or (req.return_token_ids and new_tokens))):
                        yield emit(out, ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(content=delta), logprobs=lp,
                            token_ids=list(new_tokens) if req.return_token_ids else None))
                    first = len(parsers[c.index].calls) - len(calls) if calls else 0
                    for k, call in enumerate(calls, start=first):  # k: the call's index in the reply
                        yield emit(out, ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(tool_calls=[
                                {"index": k, "id": call.id, "type": "function",
                                 "function": {"name": call.name, "arguments": ""}}])))
                        yield emit(out, ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(tool_calls=[
                                {"index": k, "function": {"arguments": call.arguments}}])))
                    if c.finished:
                        p.done = True
                        completion_tokens += len(c.token_ids)
                        finish = c.finish_reason
                        if finish == "stop" and c.index in parsers and parsers[c.index].calls:
                            finish = "tool_calls"
                            self.tools_called(started, [k.name for k in parsers[c.index].calls])
                        yield emit(out, ChatStreamChoice(
                            index=c.index, delta=DeltaMessage(), finish_reason=finish))
            if req.stream_options and req.stream_options.include_usage:
                prompt_tokens = len(started.prompt_ids[0])
                yield sse(ChatCompletionChunk(id=cid, model=req.model or self.model_name, choices=[],
                                              usage=usage(prompt_tokens, completion_tokens, cached)))
            yield DONE
        except _ENGINE_ERRORS as e:
            yield sse_error(api_error(e))
            yield DONE
        finally:
            self._abort(started)

    def _chat_logprobs(self, entries, token_ids, top_n: int) -> ChatLogprobs:
        content = []
        for tid, entry in zip(token_ids, entries or []):
            chosen = entry.get(tid)
            tok = chosen.decoded_token if chosen else self.tokenizer.token_text(tid)
            tops = sorted(entry.values(), key=lambda lp: lp.rank)[:top_n]
            content.append(ChatTokenLogprob(
                token=tok, logprob=chosen.logprob if chosen else float("-inf"), bytes=list(tok.encode()),
                top_logprobs=[TopLogprob(token=t.decoded_token, logprob=t.logprob, bytes=list(t.decoded_token.encode()))
                              for t in tops]))
        return ChatLogprobs(content=content)


def _concat_logprobs(a: CompletionLogprobs, b: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(text_offset=a.text_offset + b.text_offset, token_logprobs=a.token_logprobs
                              + b.token_logprobs, tokens=a.tokens + b.tokens, top_logprobs=a.top_logprobs
                              + b.top_logprobs)


@dataclass
class ChatTools:
    """A chat request's tools and tool_choice: how they shape the prompt, the grammar
    (tool_choice required or a named function) and the reply (entrypoints/openai/tool_calls.py)."""
    tools: list[tool_calls.Tool]
    choice: str | tool_calls.Tool | None
    grammar: StructuredOutputsParams | None

    @classmethod
    def of(cls, tools, tool_choice, parallel: bool) -> "ChatTools":
        parsed = tool_calls.parse_tools(tools)
        choice = tool_calls.parse_tool_choice(tool_choice, parsed)
        grammar = None
        if choice == "required":
            grammar = tool_calls.tool_grammar(parsed, parallel)
        elif isinstance(choice, tool_calls.Tool):
            grammar = tool_calls.tool_grammar([choice], parallel=False)
        return cls(parsed, choice, grammar)

    @property
    def active(self) -> bool:
        """The reply may hold calls to parse."""
        return self.choice is not None and self.choice != "none"

    def render(self, messages: list[dict], template: str | None) -> tuple[list[dict], list[dict] | None]:
        shown = self.tools if self.active else []
        if not shown and not any(m.get("tool_calls") or m["role"] == "tool" for m in messages):
            return messages, None
        return tool_calls.render_messages(messages, shown, tool_calls.template_takes_tools(template))

    def parse(self, text: str) -> tuple[str | None, list[tool_calls.ToolCall]]:
        if not self.active:
            return text, []
        return tool_calls.parse_output(text, self.tools)

    def stream_parser(self) -> tool_calls.StreamParser:
        return tool_calls.StreamParser(self.tools)


async def _counted(stream: AsyncIterator[RequestOutput], started: _Started, i: int):
    """The stream of prompt i, noting its output tokens so far (its tenant's quota)."""
    async for out in stream:
        started.output_tokens[i] = sum(len(c.token_ids) for c in out.outputs)
        yield out


def scheduling(req, tenant: str, base_model: str) -> dict:
    """A request's scheduling fields for LLMEngine.add_request. A `model` other than the base
    model's name is a LoRA adapter's (the route has checked that it is one)."""
    lora = req.model if req.model is not None and req.model != base_model else None
    return {"session_id": req.session_id, "tenant": tenant, "priority": req.priority, "lora": lora}


def normalize_prompts(prompt) -> list:
    """OpenAI's prompt forms: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        return list(prompt)
    raise APIError(400, "prompt must not be empty", param="prompt")


def chat_message(m, index: int = 0) -> dict:
    content = m.content
    if isinstance(content, list):  # content parts: keep the text ones
        texts = []
        for j, part in enumerate(content):
            where = f"messages[{index}].content[{j}]"
            if part.get("type") != "text":
                raise APIError(400, f"{where}: unsupported content part type {part.get('type')!r}; only text "
                                    f"is supported", param="messages")
            text = part.get("text")
            if not isinstance(text, str):
                raise APIError(400, f"{where}.text must be a string, got {type(text).__name__}", param="messages")
            texts.append(text)
        content = "".join(texts)
    out = m.model_dump(exclude_none=True)
    out["content"] = content or ""
    return out


async def _gather_finals(streams) -> list[RequestOutput]:
    async def last(stream):
        final = None
        async for out in stream:
            final = out if out is not None else final
        return final
    return list(await asyncio.gather(*(last(s) for s in streams)))


async def _merge(streams) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as outputs arrive, tagging each with its index."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for out in stream:
                await queue.put((i, out))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
