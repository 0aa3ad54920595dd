"""The OpenAI-compatible HTTP server: FastAPI app over an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET,
DELETE), DELETE /v1/sessions/{id}, GET /v1/models[/{id}], POST /tokenize and /detokenize, GET /tokenizer_info, /health, /version, /metrics; with
--enable-weight-updates the weight and sleep routes of entrypoints/openai/weights.py. Errors are OpenAI-shaped JSON with a 4xx for every bad body; no
stack trace or internal exception text ever reaches a client, and an unexpected error
is a 500 on a connection that stays usable. A body over max_request_bytes is refused
(413) before it is read. A client that leaves a non-streaming request aborts it, as a
streaming one does. On SIGTERM the server stops accepting, open requests get
shutdown_grace_s to finish, then end with an error event and `[DONE]`.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import signal
import threading
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import sluice
from sluice.engine.async_engine import (AsyncEngine, EngineDeadError, QueueTimeoutError, RequestFailedError,
                                        RequestTimeoutError, ShuttingDownError)
from sluice.engine.llm_engine import EngineAsleepError
from sluice.entrypoints.openai.dashboard import add_dashboard_routes
from sluice.entrypoints.openai.errors import APIError, error_json
from sluice.entrypoints.openai.lora_routes import add_lora_routes
from sluice.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                 ModelCard, ModelList, TokenizeRequest)
from sluice.entrypoints.openai.quotas import RateLimiter
from sluice.entrypoints.openai.responses import ResponsesRequest, ResponsesServing, input_items_page
from sluice.entrypoints.openai.serving import OpenAIServing, ServingLimits, api_error
from sluice.entrypoints.openai.tenants import TenantSpec, key_salt
from sluice.entrypoints.openai.weights import add_weight_routes
from sluice.metrics import Metrics, step_hook
from sluice.request import MAX_SESSION_ID_CHARS

logger = logging.getLogger(__name__)


def match_key(keys: dict[bytes, tuple[str, str]], header: str) -> tuple[str, str] | None:
    """The (tenant, cache salt) of the key in an Authorization header, or None. Every key is
    compared, in constant time each, so the time taken says nothing about which matched."""
    token = (header[7:] if header.lower().startswith("bearer ") else "").encode()
    found = None
    for key, who in keys.items():
        if hmac.compare_digest(token, key):
            found = who
    return found


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1 routes, with one of the server's keys,
    and records the key's tenant in the request's state. A plain ASGI middleware, not
    Starlette's BaseHTTPMiddleware (`@app.middleware`), which passes every chunk of a
    streamed response through a memory stream and a task switch of its own."""

    def __init__(self, app, keys: dict[bytes, tuple[str, str]]):
        self.app = app
        self.keys = keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            who = match_key(self.keys, Request(scope).headers.get("authorization", ""))
            if who is None:
                response = error_json(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                return await response(scope, receive, send)
            state = scope.setdefault("state", {})
            state["tenant"], state["key_salt"] = who
        await self.app(scope, receive, send)


class _BodyTooLarge(StarletteHTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body larger than this server accepts ({limit} bytes, --max-request-bytes)")


MAX_HEADER_BYTES = 64 * 1024


class GuardMiddleware:
    """The outermost of our middlewares. Refuses headers over MAX_HEADER_BYTES (431), a body
    over `max_bytes` before reading it
    (by its Content-Length) or as soon as it passes the limit (chunked); and turns any
    exception that escaped the app into a 500 JSON response *without* re-raising it, since
    Starlette's own last-resort handler re-raises, and the server then closes the
    connection under the client's next request on it."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if sum(len(k) + len(v) for k, v in scope["headers"]) > MAX_HEADER_BYTES:
            # uvicorn refuses bigger ones only when they arrive over several reads.
            return await error_json(431, f"request headers larger than {MAX_HEADER_BYTES} bytes")(scope, receive, send)
        length = Request(scope).headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await error_json(413, _BodyTooLarge(self.max_bytes).detail)(scope, receive, send)
        seen, started = 0, False

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(self.max_bytes)  # FastAPI re-raises HTTPExceptions from the body read
            return message

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except Exception:
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await error_json(500, "internal server error")(scope, receive, send)


# What a non-streaming handler returns when its client has gone (nobody reads it).
CLIENT_CLOSED = 499


async def _client_gone(receive) -> None:
    """Returns when the client disconnects (the body has been read, so the next message
    a request gets is http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(request: Request, work):
    """Run `work` unless the client disconnects first; then cancel it (the serving code's
    `finally` aborts its engine requests) and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_client_gone(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    return None


def api_keys(config: "ServerConfig") -> dict[bytes, tuple[str, str]]:
    """Each key the server takes -> (its tenant, its prefix-cache namespace)."""
    keys = {t.api_key.encode(): (t.name, key_salt(t.api_key)) for t in config.tenants if t.api_key}
    if config.api_key:
        keys[config.api_key.encode()] = ("", key_salt(config.api_key))
    return keys


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "smollm2-135m"
    api_key: str | None = None
    # More keys, each its own tenant (entrypoints/openai/tenants.py); entries without a key
    # only give a `user` value its weight (the engine's tenant_weights).
    tenants: list[TenantSpec] = field(default_factory=list)
    # Waiting sequences, the largest n, the request timeout, the SSE keep-alive interval.
    limits: ServingLimits = field(default_factory=ServingLimits)
    # Bodies larger than this are refused with 413 before they are read.
    max_request_bytes: int = 4 * 2**20
    # On SIGTERM, seconds open requests get to finish before they are ended with an error.
    shutdown_grace_s: float = 2.0
    # POST /v1/weights/*, /sleep and /wake_up (entrypoints/openai/weights.py); off: 404.
    enable_weight_updates: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_routes.py); off: 404.
    enable_lora_updates: bool = False
    # The engine core (scheduler, runner, outputs) in a process of its own beside this one
    # (engine/core_process.py); off: in a thread of this process.
    engine_process: bool = False


def build_app(engine: AsyncEngine, config: ServerConfig, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="sluice", version=sluice.__version__)
    # Tenants' rate limits (quotas.py): rpm, tpm, max_tokens, max_concurrency of the file.
    quotas = RateLimiter.for_tenants(config.tenants)
    metrics.quotas = quotas
    serving = OpenAIServing(engine, config.served_model_name, config.limits, quotas)
    responses = ResponsesServing(serving)
    app.state.engine = engine
    app.state.quotas = quotas

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_json(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return error_json(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
            return error_json(400, "request body must be a JSON object (send Content-Type: application/json)")
        param = loc[0] if loc else None
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        return error_json(400, f"{'.'.join(loc) or 'body'}: {msg}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_json(404, f"route {request.method} {request.url.path} not found")
        return error_json(e.status_code, str(e.detail))

    async def _engine_error(_, e: Exception):
        err = api_error(e)
        return error_json(err.status, err.message, code=err.code, headers=err.headers)

    for kind in (EngineDeadError, ShuttingDownError, RequestFailedError, RequestTimeoutError, EngineAsleepError,
                 QueueTimeoutError):
        app.add_exception_handler(kind, _engine_error)

    # With keys, each key is a tenant with its own prefix-cache and session namespace, so
    # one tenant can never hit (or time) another's cached blocks or reach its sessions.
    # (--api-key alone: one tenant, the shared one.)
    keys = api_keys(config)
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys)
    app.add_middleware(GuardMiddleware, max_bytes=config.max_request_bytes)

    def check_model(model: str | None) -> None:
        """The base model's name, a loaded LoRA adapter's, or none; else 404."""
        if model is None or model == config.served_model_name or model in engine.engine.lora_names():
            return
        adapters = sorted(engine.engine.lora_names())
        also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise APIError(404, f"the model {model!r} does not exist; this server serves "
                            f"{config.served_model_name!r}{also}", param="model", code="model_not_found")

    def respond(result, headers: dict | None = None):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        return JSONResponse(result if isinstance(result, dict) else result.model_dump(), headers=headers)

    def identity(raw: Request, user: str | None) -> tuple[str, str]:
        """(tenant, its prefix-cache namespace): the key's tenant when the server has keys,
        else the `user` field's (which namespaces sessions but not the cache)."""
        state = raw.scope.get("state", {})
        if "tenant" in state:
            return state["tenant"], state["key_salt"]
        return user or "", ""

    def salt(raw: Request, req) -> tuple[str, str | None]:
        tenant, namespace = identity(raw, req.user)
        parts = [p for p in (namespace, req.cache_salt) if p]
        return tenant, "/".join(parts) or None

    async def handle(raw: Request, work, tenant: str = ""):
        result = await until_disconnected(raw, work)
        if result is None:  # the client left; its requests are aborted
            return Response(status_code=CLIENT_CLOSED)
        # A limited tenant's remaining quota on every answer, as OpenAI's x-ratelimit-* headers.
        return respond(result, quotas.headers(tenant) if quotas is not None else None)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        check_model(req.model)
        tenant, cache_salt = salt(raw, req)
        return await handle(raw, serving.completions(req, cache_salt, tenant), tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        check_model(req.model)
        tenant, cache_salt = salt(raw, req)
        return await handle(raw, serving.chat(req, cache_salt, tenant), tenant)

    @app.post("/v1/responses")
    async def create_response(req: ResponsesRequest, raw: Request):
        check_model(req.model)
        tenant, cache_salt = salt(raw, req)
        return await handle(raw, responses.create(req, cache_salt, tenant), tenant)

    def stored_response(tenant: str, response_id: str):
        stored = responses.store.get(tenant, response_id)
        if stored is None:
            raise APIError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
        return stored

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request, user: str | None = None):
        return stored_response(identity(raw, user)[0], response_id).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def get_response_input_items(response_id: str, raw: Request, user: str | None = None, limit: int = 20,
                                       order: str = "desc", after: str | None = None):
        return input_items_page(stored_response(identity(raw, user)[0], response_id), limit, order, after)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request, user: str | None = None):
        """Forget a stored response, and release its chain's pinned KV (only a speed-up)."""
        tenant = identity(raw, user)[0]
        stored = stored_response(tenant, response_id)
        if not responses.store.delete(tenant, response_id):  # another delete got there first
            raise APIError(404, f"no stored response {response_id!r}", param="response_id", code="not_found")
        await engine.release_session(stored.session_id, tenant)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, raw: Request, user: str | None = None):
        """Release a session's pinned KV blocks now (its tenant's: the key's, or ?user=)."""
        tenant, _ = identity(raw, user)
        if len(session_id) > MAX_SESSION_ID_CHARS:
            raise APIError(400, f"session_id must be at most {MAX_SESSION_ID_CHARS} characters", param="session_id")
        released = await engine.release_session(session_id, tenant)
        if released is None:
            raise APIError(404, f"no session {session_id!r} for this tenant", param="session_id",
                           code="session_not_found")
        return {"id": session_id, "object": "session", "deleted": True, "released_blocks": released}

    add_weight_routes(app, engine, config.enable_weight_updates, config.api_key, keys, metrics)
    add_lora_routes(app, engine, config.enable_lora_updates, config.served_model_name, config.api_key, keys, metrics)
    add_dashboard_routes(app, engine, metrics, keys)

    # Routes outside /v1 that still need a key with --api-key (the middleware guards /v1):
    # vLLM's tokenizer routes and the admin action of resetting the prefix cache.
    def check_key(request: Request) -> None:
        if keys and match_key(keys, request.headers.get("authorization", "")) is None:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, raw: Request):
        check_key(raw)
        check_model(req.model)
        return await serving.tokenize(req, engine.engine.max_model_len)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest, raw: Request):
        check_key(raw)
        check_model(req.model)
        return await serving.detokenize(req, engine.engine.runner.vocab_size)

    @app.get("/tokenizer_info")
    async def tokenizer_info(raw: Request):
        # vLLM's: what a client needs to tokenize as the server does (lm-eval's remote
        # tokenizer reads the special tokens and the chat template from it).
        check_key(raw)
        return serving.tokenizer_info(engine.engine.max_model_len)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        check_key(request)
        return {"reset_blocks": await engine.reset_prefix_cache()}

    def model_cards() -> dict[str, ModelCard]:
        """The base model and each LoRA adapter (vLLM's cards: an adapter's root is its
        folder and its parent the base model)."""
        e = engine.engine
        cards = {config.served_model_name: ModelCard(id=config.served_model_name, root=str(e.model_path),
                                                     max_model_len=e.max_model_len)}
        for name, path in e.lora_names().items():
            cards[name] = ModelCard(id=name, root=path, parent=config.served_model_name, max_model_len=e.max_model_len)
        return cards

    @app.get("/v1/models")
    async def models():
        return ModelList(data=list(model_cards().values())).model_dump()

    # OpenAI's models.retrieve; `path`, since model names often hold a slash (org/name).
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(model_id)
        card = model_cards().get(model_id)
        if card is None:  # unloaded between the two looks
            raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
        return card.model_dump()

    @app.get("/health")
    async def health():
        if engine.dead:
            return error_json(503, "the engine stopped; the server is restarting")
        if not engine.accepting:
            return error_json(503, "the server is shutting down")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": sluice.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(await engine.render_metrics(metrics), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after a graceful shutdown, so the process would die
        by the signal; a server that shut down cleanly should exit 0. On the signal, the
        engine drains: open requests get the grace period, then end with an error event."""
        engine: AsyncEngine | None = None
        grace_s: float = 2.0

        def handle_exit(self, sig, frame):
            if self.engine is not None:
                self.engine.begin_drain(self.grace_s)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)
    return Server


def serve(engine_kwargs: dict, config: ServerConfig, log_level: str = "info") -> int:
    """Load the model, start the engine thread and run uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    from sluice.engine.llm_engine import LLMEngine
    metrics = Metrics(config.served_model_name)
    exit_code = 0

    server = None

    def on_dead(_error: BaseException) -> None:
        # The engine failed past recovery: stop serving and exit non-zero, so a supervisor
        # (systemd, Kubernetes, a shell loop) restarts the process, rather than answer 503.
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.should_exit = True

    if config.engine_process:
        from sluice.engine.core_process import EngineCoreClient
        engine = EngineCoreClient(engine_kwargs, config.served_model_name, on_dead=on_dead,
                                  log_level=logging.getLevelName(logging.getLogger().level))
    else:
        # The model loads in the engine thread, where it runs (see AsyncEngine).
        engine = AsyncEngine(lambda: LLMEngine.from_kwargs(**engine_kwargs), on_step=step_hook(metrics),
                             on_dead=on_dead)
    engine.start()
    if config.engine_process:
        logger.info("engine core: process %d (--no-engine-process: a thread of this one)", engine.process.pid)
    app = build_app(engine, config, metrics)
    logger.warning("sluice serving %s on http://%s:%d", config.served_model_name, config.host, config.port)
    # On SIGINT/SIGTERM uvicorn stops accepting and the engine drains: open requests get
    # shutdown_grace_s to finish, then end with an error event and [DONE]; uvicorn's own
    # deadline (when it would cancel what is left) comes after that.
    server = _server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                                            timeout_graceful_shutdown=config.shutdown_grace_s + 3))
    server.engine, server.grace_s = engine, config.shutdown_grace_s
    server.should_exit = bool(exit_code)  # the engine died before the server was made
    try:
        server.run()
    finally:
        engine.shutdown()
    if exit_code:
        logger.error("exiting with status %d: the engine could not be recovered", exit_code)
    return exit_code
