"""Data parallelism: one OpenAI endpoint over N engine replicas on Ray.

`sluice serve --data-parallel-size N` starts a local Ray cluster (or joins one with
--ray-address, which is how replicas span machines), N replicas as Ray actors, each a
whole sluice server (replicas.py), and this router in front of them. The router
forwards each request as it came (bytes in, bytes out; streams relayed chunk by chunk) to
the replica its policy picks (policy.py), so every feature of one server works through
it unchanged; it adds:

- API keys checked at the door (and again by the replica, which gets the header);
- a client that leaves closes the upstream connection, and the replica aborts the request;
- a replica that dies: its requests in flight end with a 503 (an error event and [DONE]
  on a stream), never a hang; it is out of rotation until Ray has restarted it;
- /metrics: every replica's series with a `replica` label, and the router's own
  (sluice_router_*: requests per replica and decision, in flight, replicas up, restarts);
- the weight and sleep routes sent to every replica (a trainer's group: each replica joins
  as a rank of its own, `rank_offset` + its place), and LoRA adapters loaded or unloaded
  at run time (loaded again on a replica Ray restarts); DELETE /v1/sessions to every replica;
  stored responses (`previous_response_id`, GET/DELETE /v1/responses/{id}) to the replica
  that stored them.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from urllib.parse import quote

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from starlette.exceptions import HTTPException as StarletteHTTPException

import sluice
from sluice.entrypoints.openai.api_server import (CLIENT_CLOSED, APIKeyMiddleware, GuardMiddleware, ServerConfig,
                                                   api_keys, until_disconnected)
from sluice.entrypoints.openai.errors import APIError, error_json, error_payload
from sluice.entrypoints.openai.quotas import NeverFits, RateLimited, RateLimiter
from sluice.entrypoints.router.policy import RouterPolicy
from sluice.entrypoints.router.replicas import ReplicaSet

logger = logging.getLogger(__name__)

FORWARD_HEADERS = ("authorization", "content-type", "accept")
RETURN_HEADERS = ("content-type", "retry-after", "cache-control")
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9a-f]+)"')


@dataclass
class DataParallelConfig:
    size: int = 1
    # None: start a local Ray cluster; else the address of one to join ("auto", "ray://...").
    ray_address: str | None = None
    policy: str = "cache_aware"
    # Ray CPUs each replica asks for, and its torch threads (None: this machine's cores / size).
    replica_cpus: int | None = None
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5


class _Relay(StreamingResponse):
    """A relayed stream whose upstream is closed however the response ends: a client gone
    before the first chunk never starts the body's generator, so its own `finally` would
    not run."""

    def __init__(self, body, close, **kw):
        super().__init__(body, media_type="text/event-stream", **kw)
        self.close = close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.close()


# How often the router reads the replicas' per-tenant token counters (tenants' tpm).
USAGE_POLL_S = 1.0


class RouterMetrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sluice_router_requests", "Requests routed, by replica and decision (session, "
                                "response, round_robin, least_loaded, balance, cache_hit, cache_miss)",
                                ["replica", "decision"], registry=r)
        self.inflight = Gauge("sluice_router_requests_in_flight", "Requests in flight per replica", ["replica"],
                              registry=r)
        self.up = Gauge("sluice_router_replica_up", "1 while a replica is in rotation", ["replica"], registry=r)
        self.restarts = Gauge("sluice_router_replica_restarts", "Times a replica came back on a new address "
                              "(restarted by Ray)", ["replica"], registry=r)
        self.rate_limited = Counter("sluice_router_rate_limited", "Requests refused by a tenant's rate limits "
                                    "(429)", ["tenant"], registry=r)


def routing_text(path: str, data: dict) -> str:
    """The text whose prefix a request shares with others: its prompt, or its messages or
    input in order (a later turn of a conversation extends an earlier one's)."""
    if path == "/v1/completions":
        p = data.get("prompt")
        if isinstance(p, list) and p:
            p = p[0]
        return p if isinstance(p, str) else ",".join(map(str, p)) if isinstance(p, list) else ""
    parts = []
    if path == "/v1/responses":
        parts.append(str(data.get("instructions") or ""))
        items = data.get("input")
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
    else:
        items = data.get("messages")
    for m in items if isinstance(items, list) else []:
        if isinstance(m, dict):
            content = m.get("content")
            parts.append(f"{m.get('role', m.get('type', ''))}\x00"
                         f"{content if isinstance(content, str) else json.dumps(content, sort_keys=True)}\x01")
    return "".join(parts)


def build_router_app(replicas: ReplicaSet, policy: RouterPolicy, config: ServerConfig) -> FastAPI:
    metrics = RouterMetrics()
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))

    # Tenants' rate limits (entrypoints/openai/quotas.py), held here so that they hold across
    # replicas: requests and concurrency counted as they pass, tokens as the replicas report
    # having served them (poll_usage).
    quotas = RateLimiter.for_tenants(config.tenants)

    async def poll_usage() -> None:
        """Forever: each replica's per-tenant token counters (its /metrics), the growth
        since the last look charged to the tenant. A restarted replica (a new address)
        counts from zero."""
        seen: dict[str, dict[str, float]] = {}
        while True:
            await asyncio.sleep(USAGE_POLL_S)
            ids = up()
            texts = await asyncio.gather(*[_get_text(client, f"{replicas.urls[i]}/metrics") for i in ids])
            for i, text in zip(ids, texts):
                if text is None:
                    continue
                prev = seen.setdefault(replicas.urls[i], {})
                for tenant, total in tenant_tokens(text).items():
                    if total > prev.get(tenant, 0.0):
                        quotas.charge(tenant, int(total - prev.get(tenant, 0.0)))
                        prev[tenant] = total

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        monitor = asyncio.create_task(replicas.monitor(client))
        usage = asyncio.create_task(poll_usage()) if quotas is not None else None
        try:
            yield
        finally:
            monitor.cancel()
            if usage is not None:
                usage.cancel()
            await client.aclose()

    app = FastAPI(title="sluice router", version=sluice.__version__, lifespan=lifespan)
    keys = api_keys(config)
    if keys:
        app.add_middleware(APIKeyMiddleware, keys=keys)
    app.add_middleware(GuardMiddleware, max_bytes=config.max_request_bytes)
    groups: dict[str, list[int]] = {}          # trainer group -> its replicas
    last = {"update": None}                    # the last update's body, if a path one (replayable)
    loras: dict[str, dict] = {}                # LoRA adapters loaded at run time: name -> load body
    admin_headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}

    async def on_restart(i: int, url: str) -> None:
        """A restarted replica lost its cache, pins and updated weights: re-apply the last
        update if it came from a path, else keep it out of rotation until the next one."""
        policy.forget(i)
        for body in list(loras.values()):  # the adapters loaded at run time, loaded again
            r = await client.post(f"{url}/v1/load_lora_adapter", json=body, headers=admin_headers)
            if r.status_code != 200:
                replicas.stale[i] = True
        update = last["update"]
        if update is None:
            return
        if "path" in update:
            r = await client.post(f"{url}/v1/weights/update", json=update, headers=admin_headers)
            replicas.stale[i] = r.status_code != 200
        else:
            replicas.stale[i] = True

    replicas.on_restart = on_restart

    def unavailable_payload(replica: int, why: str) -> dict:
        body = error_payload(503, f"replica {replica} became unavailable ({why}); the request was ended and the "
                                  f"replica is being restarted: retry")
        body["error"]["code"] = "replica_unavailable"
        return body

    def unavailable(replica: int, why: str) -> JSONResponse:
        return JSONResponse(unavailable_payload(replica, why), status_code=503, headers={"Retry-After": "2"})

    def headers_of(raw: Request) -> dict:
        return {k: v for k, v in raw.headers.items() if k.lower() in FORWARD_HEADERS}

    async def forward(raw: Request, replica: int, body: bytes, ticket=None, extra: dict | None = None) -> Response:
        """Relay the request to a replica. ticket: its tenant's rate-limit hold, released
        when the request ends; extra: headers added to the answer (x-ratelimit-*)."""
        url = f"{replicas.urls[replica]}{raw.url.path}" + (f"?{raw.url.query}" if raw.url.query else "")
        policy.inflight[replica] += 1
        metrics.inflight.labels(str(replica)).set(policy.inflight[replica])
        upstream: httpx.Response | None = None
        done = False

        async def close() -> None:
            """Close the upstream response (a replica sees the client leave) and stop
            counting the request; once, whichever path gets here first."""
            nonlocal done
            if done:
                return
            done = True
            if ticket is not None:
                quotas.release(ticket)
            policy.inflight[replica] -= 1
            metrics.inflight.labels(str(replica)).set(policy.inflight[replica])
            if upstream is not None:
                await upstream.aclose()
        try:
            upstream = await client.send(client.build_request(raw.method, url, content=body, headers=headers_of(raw)),
                                         stream=True)
        except httpx.HTTPError as e:
            await close()
            replicas.mark_down(replica, type(e).__name__)
            return unavailable(replica, type(e).__name__)
        headers = {**{k: v for k, v in upstream.headers.items() if k.lower() in RETURN_HEADERS}, **(extra or {})}
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return _Relay(relay(upstream, replica, raw.url.path, close), close, status_code=upstream.status_code,
                          headers={**headers, "X-Accel-Buffering": "no"})
        try:
            content = await until_disconnected(raw, upstream.aread())
        except httpx.HTTPError as e:
            replicas.mark_down(replica, type(e).__name__)
            return unavailable(replica, type(e).__name__)
        finally:
            await close()
        if content is None:  # the client left; closing the connection aborted the request upstream
            return Response(status_code=CLIENT_CLOSED)
        if raw.url.path == "/v1/responses" and upstream.status_code == 200:
            m = _RESPONSE_ID.search(content)
            if m:
                policy.stored(m.group(1).decode(), replica)
        return Response(content, status_code=upstream.status_code, headers=headers)

    async def relay(resp: httpx.Response, replica: int, path: str, close):
        sniff = path == "/v1/responses"
        try:
            async for chunk in resp.aiter_raw():
                if sniff and (m := _RESPONSE_ID.search(chunk)):
                    policy.stored(m.group(1).decode(), replica)
                    sniff = False
                yield chunk
        except httpx.HTTPError as e:
            replicas.mark_down(replica, type(e).__name__)
            body = unavailable_payload(replica, type(e).__name__)
            yield f"\n\ndata: {json.dumps(body)}\n\ndata: [DONE]\n\n".encode()
        finally:
            await close()

    def no_replica() -> JSONResponse:
        return error_json(503, "no replica is up (they are starting or restarting); retry", code="no_replica",
                          headers={"Retry-After": "2"})

    def session_of(raw: Request, data: dict):
        sid = data.get("session_id")
        if not isinstance(sid, str):
            return None
        tenant = raw.scope.get("state", {}).get("tenant")
        return (tenant if tenant is not None else str(data.get("user") or ""), sid)

    async def generate(raw: Request):
        body = await raw.body()
        try:
            data = json.loads(body)
        except ValueError:
            data = None
        data = data if isinstance(data, dict) else {}
        healthy = replicas.healthy()
        if not healthy:
            return no_replica()
        prev = data.get("previous_response_id")
        text = routing_text(raw.url.path, data)
        ticket, extra = None, None
        tenant = raw.scope.get("state", {}).get("tenant")
        tenant = tenant if tenant is not None else str(data.get("user") or "")
        if quotas is not None and quotas.limits(tenant) is not None:
            # The prompt's tokens estimated from its characters (~4 a token: OpenAI's own
            # estimate at admission); what the request used is charged as it is served.
            out = next((v for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                        if isinstance(v := data.get(k), int) and v > 0), 0)
            n = data.get("n") if isinstance(data.get("n"), int) and data.get("n") > 0 else 1
            try:
                ticket = quotas.admit(tenant, len(text) // 4, n * out, take_prompt=False)
            except RateLimited as e:
                metrics.rate_limited.labels(tenant).inc()
                return error_json(429, str(e), code="rate_limit_exceeded", headers=e.headers)
            except NeverFits as e:
                return error_json(400, str(e), param="max_tokens", code="rate_limit_exceeded")
            extra = quotas.headers(tenant)
        replica, why = policy.pick(healthy, text, session_of(raw, data), prev if isinstance(prev, str) else None)
        metrics.requests.labels(str(replica), why).inc()
        return await forward(raw, replica, body, ticket, extra)

    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        app.add_api_route(path, generate, methods=["POST"])

    async def call(i: int, method: str, path: str, raw: Request | None = None, body=None, **kw):
        """One replica's answer as (status, JSON body); a connection failure is a 503."""
        headers = headers_of(raw) if raw is not None else admin_headers
        try:
            r = await client.request(method, f"{replicas.urls[i]}{path}", json=body, headers=headers, **kw)
        except httpx.HTTPError as e:
            replicas.mark_down(i, type(e).__name__)
            return 503, error_payload(503, f"replica {i} became unavailable ({type(e).__name__})")
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, {"error": {"message": r.text}}

    async def fan_out(raw: Request, method: str, path: str, bodies: dict[int, dict | None], **kw):
        """Every replica in `bodies` at once; 200 with their answers by replica when all
        agree to it, else the first failure's status with every replica's answer."""
        if not bodies:
            return no_replica()
        results = await asyncio.gather(*[call(i, method, path, raw, b, **kw) for i, b in bodies.items()])
        answers = {str(i): body for i, (_, body) in zip(bodies, results)}
        failed = [(i, status) for i, (status, _) in zip(bodies, results) if status != 200]
        if failed:
            i, status = failed[0]
            message = (f"replica(s) {', '.join(str(j) for j, _ in failed)} refused or failed; the first: "
                       f"{answers[str(i)].get('error', {}).get('message', answers[str(i)])}")
            return JSONResponse({"error": {"message": message, "type": "replica_error", "param": None,
                                           "code": "replica_error"}, "replicas": answers}, status_code=status)
        return {"replicas": answers}

    def common_version(answers: dict[str, dict]):
        """The replicas' weight_version when they all have the same one, else None."""
        versions = {a["weight_version"] for a in answers.values()}
        return versions.pop() if len(versions) == 1 else None

    def up() -> list[int]:
        return [i for i in range(replicas.n) if replicas.up[i]]

    async def json_body(raw: Request) -> dict:
        try:
            body = await raw.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise APIError(400, "the body must be a JSON object")
        return body

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return error_json(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            return error_json(404, f"route {request.method} {request.url.path} not found")
        return error_json(e.status_code, str(e.detail))

    # -- every replica -----------------------------------------------------------
    @app.get("/v1/weights")
    async def weights(raw: Request):
        result = await fan_out(raw, "GET", "/v1/weights", {i: None for i in up()})
        if not isinstance(result, dict):
            return result
        answers = result["replicas"]
        return {"weight_version": common_version(answers), "ranks": len(answers),
                "asleep": any(a["asleep"] for a in answers.values()),
                "enabled": all(a["enabled"] for a in answers.values()), "replicas": answers}

    @app.post("/v1/weights/init_group")
    async def init_group(raw: Request):
        body = await json_body(raw)
        members = up()
        if not isinstance(body.get("rank_offset", 1), int):
            return error_json(400, "rank_offset must be an integer", param="rank_offset")
        offset = body.get("rank_offset", 1)
        result = await fan_out(raw, "POST", "/v1/weights/init_group",
                               {i: {**body, "rank_offset": offset + j} for j, i in enumerate(members)})
        if isinstance(result, dict):
            groups[str(body.get("group_name"))] = members
        return result

    @app.post("/v1/weights/update")
    async def update(raw: Request):
        body = await json_body(raw)
        members = groups.get(str(body.get("group_name"))) if body.get("group_name") is not None else up()
        if members is None:
            return error_json(404, f"no open group {body.get('group_name')!r}: POST /v1/weights/init_group first",
                              param="group_name", code="group_not_found")
        result = await fan_out(raw, "POST", "/v1/weights/update", {i: body for i in members})
        if isinstance(result, dict):
            last["update"] = body if body.get("path") is not None else {"group_name": body.get("group_name")}
            for i in members:
                replicas.stale[i] = False
            result["weight_version"] = common_version(result["replicas"])
        return result

    @app.post("/v1/weights/close_group")
    async def close_group(raw: Request):
        body = await json_body(raw)
        members = groups.pop(str(body.get("group_name")), None)
        if members is None:
            return error_json(404, "no open group of that name", param="group_name", code="group_not_found")
        return await fan_out(raw, "POST", "/v1/weights/close_group", {i: body for i in members if replicas.up[i]})

    for path in ("/sleep", "/wake_up", "/reset_prefix_cache"):
        async def everywhere(raw: Request, path=path):
            return await fan_out(raw, "POST", path, {i: None for i in up()})
        app.add_api_route(path, everywhere, methods=["POST"])

    async def lora_everywhere(raw: Request, path: str, load: bool):
        """LoRA adapters load and unload on every replica, and are loaded again on a replica
        that restarts."""
        body = await json_body(raw)
        result = await fan_out(raw, "POST", path, {i: body for i in up()})
        if not isinstance(result, dict):
            return result
        if load:
            loras[str(body.get("lora_name"))] = body
        else:
            loras.pop(str(body.get("lora_name")), None)
        verb = "added" if load else "removed"
        return PlainTextResponse(f"Success: LoRA adapter '{body.get('lora_name')}' {verb} successfully.")

    @app.post("/v1/load_lora_adapter")
    async def load_lora(raw: Request):
        return await lora_everywhere(raw, "/v1/load_lora_adapter", True)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora(raw: Request):
        return await lora_everywhere(raw, "/v1/unload_lora_adapter", False)

    @app.get("/is_sleeping")
    async def is_sleeping(raw: Request):
        result = await fan_out(raw, "GET", "/is_sleeping", {i: None for i in up()})
        if not isinstance(result, dict):
            return result
        return {"is_sleeping": any(a["is_sleeping"] for a in result["replicas"].values()), **result}

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, raw: Request):
        answers = await asyncio.gather(*[call(i, "DELETE", f"/v1/sessions/{session_id}", raw,
                                              params=dict(raw.query_params)) for i in up()])
        found = [body for status, body in answers if status == 200]
        if found:
            return {**found[0], "released_blocks": sum(b.get("released_blocks", 0) for b in found)}
        status, body = answers[0] if answers else (503, error_payload(503, "no replica is up"))
        return JSONResponse(body, status_code=status)

    async def stored_response(raw: Request, response_id: str, method: str, suffix: str = ""):
        """The replica that stored a response first, then the others until one has it."""
        first = policy.responses.get(response_id)
        order = sorted(up(), key=lambda i: i != first)
        status, body = 404, error_payload(404, f"no stored response {response_id!r}")
        for i in order:
            status, body = await call(i, method, f"/v1/responses/{response_id}{suffix}", raw,
                                      params=dict(raw.query_params))
            if status != 404:
                break
        return JSONResponse(body, status_code=status)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, raw: Request):
        return await stored_response(raw, response_id, "GET")

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, raw: Request):
        return await stored_response(raw, response_id, "DELETE")

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, raw: Request):
        return await stored_response(raw, response_id, "GET", "/input_items")

    # -- any replica (they serve the same model and tokenizer) ------------------
    async def any_replica(raw: Request, method: str, path: str, body: dict | None = None):
        healthy = replicas.healthy()
        if not healthy:
            return no_replica()
        status, answer = await call(healthy[0], method, path, raw, body)
        return JSONResponse(answer, status_code=status)

    @app.get("/v1/models")
    async def models(raw: Request):
        return await any_replica(raw, "GET", "/v1/models")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, raw: Request):
        return await any_replica(raw, "GET", "/v1/models/" + quote(model_id, safe="/"))

    for path in ("/tokenize", "/detokenize"):
        async def tokenizer_route(raw: Request, path=path):
            return await any_replica(raw, "POST", path, await json_body(raw))
        app.add_api_route(path, tokenizer_route, methods=["POST"])

    @app.get("/tokenizer_info")
    async def tokenizer_info(raw: Request):
        return await any_replica(raw, "GET", "/tokenizer_info")

    @app.get("/health")
    async def health():
        if not replicas.healthy():
            return no_replica()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": sluice.__version__}

    @app.get("/metrics")
    async def prometheus():
        healthy = replicas.healthy()
        for i in range(replicas.n):
            metrics.up.labels(str(i)).set(1 if i in healthy else 0)
            metrics.restarts.labels(str(i)).set(replicas.restarts[i])
        ids = up()  # once: a replica may go down while the others answer
        texts = await asyncio.gather(*[_get_text(client, f"{replicas.urls[i]}/metrics") for i in ids])
        merged = merge_metrics(dict(zip(ids, texts)))
        return Response(merged + generate_latest(metrics.registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.state.replicas, app.state.policy, app.state.metrics, app.state.quotas = replicas, policy, metrics, quotas
    return app


_TENANT_TOKENS = re.compile(r'^sluice_tenant_(?:prompt|generation)_tokens_total\{[^}]*tenant="([^"]*)"[^}]*\} (\S+)$',
                            re.M)


def tenant_tokens(metrics_text: str) -> dict[str, float]:
    """A replica's tokens served so far per tenant (prompt + output), from its /metrics
    (its label "default" is the shared tenant "")."""
    out: dict[str, float] = {}
    for tenant, value in _TENANT_TOKENS.findall(metrics_text):
        key = "" if tenant == "default" else tenant
        out[key] = out.get(key, 0.0) + float(value)
    return out


async def _get_text(client: httpx.AsyncClient, url: str) -> str | None:
    try:
        r = await client.get(url, timeout=5.0)
        return r.text if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def merge_metrics(texts: dict[int, str | None]) -> bytes:
    """Prometheus texts of the replicas as one, each sample labelled with its replica."""
    merged = {}
    for i, text in texts.items():
        if not text:
            continue
        for fam in text_string_to_metric_families(text):
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = type(fam)(fam.name, fam.documentation, fam.type, fam.unit)
            into.samples.extend(s._replace(labels={**s.labels, "replica": str(i)}) for s in fam.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return generate_latest(registry)


def serve_data_parallel(engine_kwargs: dict, config: ServerConfig, dp: DataParallelConfig,
                        log_level: str = "info") -> int:
    """Start (or join) Ray, the replicas and the router; serve until SIGINT/SIGTERM."""
    import ray
    import uvicorn

    from sluice.config import EngineConfig
    from sluice.entrypoints.openai.api_server import _server_class
    EngineConfig.from_kwargs(**engine_kwargs)  # a bad setting fails here, not in N actors
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per proxied request and health check
    cpus = dp.replica_cpus or max(1, (os.cpu_count() or 1) // dp.size)
    policy = RouterPolicy(dp.size, dp.policy, dp.cache_threshold, dp.balance_abs, dp.balance_rel)
    if dp.ray_address is None:  # a cluster of our own, even if another runs on this machine
        ray.init(address="local", num_cpus=cpus * dp.size, include_dashboard=False, logging_level=logging.WARNING,
                 object_store_memory=128 * 2**20)
    else:
        ray.init(address=dp.ray_address, logging_level=logging.WARNING)
    replicas = None
    try:
        replicas = ReplicaSet(ray, dp.size, engine_kwargs, dataclasses.replace(config, port=0), cpus, cpus)
        asyncio.run(replicas.start())
        app = build_router_app(replicas, policy, config)
        logger.warning("sluice serving %s on http://%s:%d: %d replicas on Ray, %s routing",
                       config.served_model_name, config.host, config.port, dp.size, dp.policy)
        server = _server_class()(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                                                timeout_graceful_shutdown=config.shutdown_grace_s + 3))
        server.run()
    finally:
        if replicas is not None:
            replicas.shutdown()
        ray.shutdown()
    return 0
