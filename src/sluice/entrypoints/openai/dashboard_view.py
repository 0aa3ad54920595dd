"""The dashboard's view of the engine: what one event of `GET /dashboard/events` carries
(dashboard.py serves it). Apart from the routes, so that the engine-core process, which
answers the server's asks for it, builds it without importing the web framework."""
from __future__ import annotations

import statistics
import time


def _pct(values, q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return round(v[min(len(v) - 1, int(q * len(v)))] * 1e3, 1)


def snapshot(engine, metrics) -> dict:
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
