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
import statistics
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from sluice.engine.async_engine import AsyncEngine
from sluice.entrypoints.openai.errors import APIError

EVENT_S = 0.5
_PAGE = Path(__file__).parent / "static" / "dashboard.html"


def _pct(values, q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))] * 1e3, 1)


def snapshot(engine: AsyncEngine, metrics) -> dict:
    """The engine as the page shows it (read between or during steps: counts, not a
    consistent cut)."""
    e = engine.engine
    sched, kv, r = e.scheduler, e.kv, metrics.recent
    used = kv.num_blocks - kv.num_free_blocks
    pinned = sched.sessions.num_pinned
    running_blocks = sum(kv.blocks_held(q.num_tokens) for q in list(sched.running))
    # The prefix cache's own: blocks that hold a cached prefix and nobody holds (free, but
    # a later request with that prefix takes them back).
    cached = sum(1 for b in list(kv.pool.cached.values()) if b.ref_cnt == 0)
    weights = sched.tenants.weights
    tokens = dict(r.tenant_tokens)
    total = sum(tokens.values()) or 1
    names = sorted(set(tokens) | set(weights))
    wsum = sum(weights.get(n, 1.0) for n in names) or 1.0
    tenants = [{"name": n, "tokens": tokens.get(n, 0), "share": round(tokens.get(n, 0) / total, 3),
                "weight": weights.get(n, 1.0), "weight_share": round(weights.get(n, 1.0) / wsum, 3)} for n in names]
    lora = getattr(e, "lora", None)
    steps = list(r.steps)[-60:]
    return {
        "time": time.time(),
        "steps": e.timings.steps,
        "recent_steps": [{"prompt": p, "decode": d, "drafted": dr, "accepted": a, "ms": round(ms, 2)}
                         for p, d, dr, a, ms in steps],
        "running": sched.num_running,
        "waiting": sched.num_waiting,
        "finished": r.finished,
        "kv": {"total": kv.num_blocks, "used": used, "free": kv.num_free_blocks, "pinned": pinned,
               "running": running_blocks, "cached": cached},
        "tenants": tenants,
        "latency_ms": {"ttft_p50": _pct(r.ttft, 0.5), "ttft_p99": _pct(r.ttft, 0.99),
                       "tpot_p50": _pct(r.tpot, 0.5), "tpot_p99": _pct(r.tpot, 0.99)},
        "adapters": [a.name for a in lora.resident if a is not None] if lora is not None else [],
        "step_ms_p50": round(statistics.median(s[4] for s in steps), 2) if steps else None,
    }


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
