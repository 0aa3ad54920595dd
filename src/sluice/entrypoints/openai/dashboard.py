"""The live dashboard: `GET /dashboard`, a page sluice serves itself (static/dashboard.html:
plain HTML, CSS and JavaScript, nothing fetched from elsewhere), fed by server-sent events
from `GET /dashboard/events`.

Each event is one snapshot of the engine, sent every EVENT_S seconds whatever the step
rate: the batch's last steps (prompt vs decode tokens, drafts verified and accepted, step
time), requests running and waiting, KV blocks by owner (running requests, pinned
sessions, cached prefixes nobody holds, free), each tenant's share of the tokens served against its
weight's share, TTFT / TPOT percentiles over the last requests, and the LoRA adapters
resident. The engine thread only appends a tuple per step and per finished request
(metrics.Recent); the snapshot is read on the server's loop, so the dashboard costs the
engine's steps nothing but those appends.

With API keys, both routes take the server's or a tenant's key, as `Authorization: Bearer`
or as `?key=` (a browser's EventSource sends no headers).
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from sluice.engine.async_engine import AsyncEngine
from sluice.entrypoints.openai.dashboard_view import snapshot
from sluice.entrypoints.openai.errors import APIError

EVENT_S = 0.5
_PAGE = Path(__file__).parent / "static" / "dashboard.html"


def add_dashboard_routes(app: FastAPI, engine: AsyncEngine, metrics, keys: dict[bytes, tuple[str, str]]) -> None:
    from sluice.entrypoints.openai.api_server import match_key

    def check(raw: Request) -> None:
        if not keys:
            return
        header = raw.headers.get("authorization", "")
        key = raw.query_params.get("key")
        if match_key(keys, header) is None and (key is None or match_key(keys, f"Bearer {key}") is None):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>' or ?key=<key>",
                           code="invalid_api_key")

    @app.get("/dashboard")
    async def dashboard(raw: Request):
        check(raw)
        return HTMLResponse(_PAGE.read_text())

    @app.get("/dashboard/events")
    async def events(raw: Request):
        check(raw)

        async def stream():
            while True:
                if await raw.is_disconnected():
                    return
                # With an engine-core process the engine's state is in that process: ask it.
                remote = getattr(engine, "dashboard_snapshot", None)
                view = await remote(metrics) if remote is not None else snapshot(engine, metrics)
                yield f"data: {json.dumps(view)}\n\n"
                await asyncio.sleep(EVENT_S)
        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
