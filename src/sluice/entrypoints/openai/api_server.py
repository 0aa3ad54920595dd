"""The OpenAI-compatible HTTP server: FastAPI app over an AsyncEngine.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, /health,
/version, /metrics. Errors are OpenAI-shaped JSON; no stack trace ever reaches a client.
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import signal
import threading
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import sluice
from sluice.engine.async_engine import AsyncEngine, EngineDeadError
from sluice.entrypoints.openai.errors import APIError, error_json
from sluice.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, ModelCard,
                                                 ModelList)
from sluice.entrypoints.openai.serving import OpenAIServing
from sluice.metrics import Metrics

logger = logging.getLogger(__name__)


class APIKeyMiddleware:
    """Requires `Authorization: Bearer <key>` on /v1 routes. A plain ASGI middleware, not
    Starlette's BaseHTTPMiddleware (`@app.middleware`), which passes every chunk of a
    streamed response through a memory stream and a task switch of its own."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            header = Request(scope).headers.get("authorization", "")
            token = header[7:] if header.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), self.key):
                response = error_json(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                      code="invalid_api_key")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)

@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str = "smollm2-135m"
    api_key: str | None = None
    # Requests allowed to wait for a seat; past it new requests get 429 + Retry-After.
    max_waiting: int = 1024


def build_app(engine: AsyncEngine, config: ServerConfig, metrics: Metrics) -> FastAPI:
    app = FastAPI(title="sluice", version=sluice.__version__)
    serving = OpenAIServing(engine, config.served_model_name)
    app.state.engine = engine

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
        msg = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        return error_json(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_json(404, f"route {request.method} {request.url.path} not found")
        return error_json(e.status_code, str(e.detail))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_, e: EngineDeadError):
        return error_json(503, str(e))

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        logger.exception("internal error")
        return error_json(500, "internal server error")

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)

    def admit(model: str | None) -> None:
        if model is not None and model != config.served_model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                                f"{config.served_model_name!r}", param="model", code="model_not_found")
        if engine.num_waiting >= config.max_waiting:
            raise APIError(429, f"server overloaded: {engine.num_waiting} requests waiting "
                                f"(max_waiting={config.max_waiting}); retry later",
                           code="overloaded", headers={"Retry-After": "1"})

    def respond(result):
        if hasattr(result, "__aiter__"):
            return StreamingResponse(result, media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(result.model_dump())

    # With API keys, each key is a tenant with its own prefix-cache namespace, so one
    # tenant can never hit (or time) another's cached blocks.
    tenant = hashlib.sha256(config.api_key.encode()).hexdigest()[:16] if config.api_key else ""

    def salt(req) -> str | None:
        parts = [p for p in (tenant, req.cache_salt) if p]
        return "/".join(parts) or None

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        admit(req.model)
        return respond(await serving.completions(req, salt(req)))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        admit(req.model)
        return respond(await serving.chat(req, salt(req)))

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request):
        if config.api_key:  # an admin action: needs the key even though it is not under /v1
            header = request.headers.get("authorization", "")
            if not hmac.compare_digest(header.encode(), f"Bearer {config.api_key}".encode()):
                return error_json(401, "missing or invalid API key", code="invalid_api_key")
        return {"reset_blocks": await engine.reset_prefix_cache()}

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[ModelCard(id=config.served_model_name,
                                         max_model_len=engine.engine.max_model_len)]).model_dump()

    @app.get("/health")
    async def health():
        if engine.dead:
            return error_json(503, "engine stopped")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": sluice.__version__}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def observe(metrics: Metrics):
    """The engine thread's per-step hook: engine gauges, and per-request latencies at finish."""
    def on_step(engine, outputs, seconds):
        metrics.observe_step(engine, outputs, seconds)
        for out in outputs:
            if out.finished and out.times is not None:
                for c in out.outputs:
                    metrics.observe_request(out.times.arrival, out.times.first_scheduled, out.times.first_token,
                                            len(out.prompt_token_ids), len(c.token_ids), c.finish_reason)
    return on_step


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM after a graceful shutdown, so the process would die
        by the signal; a server that shut down cleanly should exit 0."""

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
    # The model loads in the engine thread, where it runs (see AsyncEngine).
    engine = AsyncEngine(lambda: LLMEngine.from_kwargs(**engine_kwargs), on_step=observe(metrics))
    engine.start()
    app = build_app(engine, config, metrics)
    logger.warning("sluice serving %s on http://%s:%d", config.served_model_name, config.host, config.port)
    # On SIGINT/SIGTERM uvicorn stops accepting; streams still open get two seconds to
    # finish, then their tasks are cancelled, which aborts their requests.
    server = _server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                                    timeout_graceful_shutdown=2))
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
