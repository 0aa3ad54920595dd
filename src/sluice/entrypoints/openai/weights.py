"""Weight updates and sleep for training loops (RL rollouts): the server's routes.

    GET  /v1/weights                  {"weight_version", "updates", "ranks", "asleep"}
    POST /v1/weights/update           {"path": ...} (safetensors file or folder, GGUF) or
                                      {"group_name", "tensors": [{name, dtype, shape}]}
                                      (+ "weight_version"): the new weights, checked whole
                                      against the model before anything changes (400 naming
                                      the tensor)
    POST /v1/weights/init_group       join a trainer's torch.distributed group
                                      {master_address, master_port, rank_offset, world_size,
                                      group_name, backend: "gloo", timeout_s}
    POST /v1/weights/close_group      {"group_name"}
    POST /sleep, POST /wake_up        free / restore the KV cache (409 while requests run)
    GET  /is_sleeping                 {"is_sleeping": bool}

All but the two GETs are off unless the server runs with --enable-weight-updates (404
saying so), and with API keys they need the server's own --api-key (a tenant's key is
refused: it would change the model for every tenant). Weights read from disk or received
from the group arrive off the engine thread, so generation goes on meanwhile; the engine
applies them between two steps (the pause): requests in flight are recomputed on the new
weights and the prefix cache is reset (LLMEngine.update_weights). Every response then
reports the new `weight_version`.
"""
from __future__ import annotations

import asyncio
import hmac
import time

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from sluice.distributed.weight_sync import BACKENDS, WeightGroups
from sluice.engine.async_engine import AsyncEngine
from sluice.engine.llm_engine import EngineBusyError, read_weights
from sluice.entrypoints.openai.errors import APIError


class InitGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(default=1, ge=1)
    world_size: int = Field(ge=2)
    group_name: str = Field(min_length=1, max_length=128)
    backend: str = "gloo"
    timeout_s: float = Field(default=60.0, gt=0, le=3600)


class UpdateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str | None = None
    group_name: str | None = None
    tensors: list[dict] | None = None
    weight_version: str | None = Field(default=None, min_length=1, max_length=256)


class CloseGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    group_name: str


def admin_guard(enabled: bool, flag: str, code: str, what: str, admin_key: str | None,
                keys: dict[bytes, tuple[str, str]]):
    """The check of routes that change what every tenant is served (weights, sleep, LoRA
    adapters): on only with their flag (else 404 naming it); with keys, only for the
    server's own --api-key (401 without a valid key, 403 for a tenant's)."""
    def admin(raw: Request) -> None:
        if not enabled:
            raise APIError(404, f"{raw.url.path} is off on this server: start it with {flag}", code=code)
        if not keys:
            return
        header = raw.headers.get("authorization", "")
        token = (header[7:] if header.lower().startswith("bearer ") else "").encode()
        if admin_key is not None and hmac.compare_digest(token, admin_key.encode()):
            return
        if not any(hmac.compare_digest(token, k) for k in keys):
            raise APIError(401, f"missing or invalid API key: {what} need the server's --api-key",
                           code="invalid_api_key")
        raise APIError(403, f"{what} need the server's --api-key; a tenant's key cannot change "
                            "the model for every tenant", code="forbidden")
    return admin


def add_weight_routes(app: FastAPI, engine: AsyncEngine, enabled: bool, admin_key: str | None,
                      keys: dict[bytes, tuple[str, str]], metrics=None) -> None:
    groups = WeightGroups()
    admin = admin_guard(enabled, "--enable-weight-updates", "weight_updates_disabled", "weight and sleep routes",
                        admin_key, keys)

    def observed(result):
        if metrics is not None:
            metrics.set_weights(engine.engine.weight_version, engine.engine.num_weight_updates,
                                engine.engine.asleep)
        return result

    @app.get("/v1/weights")
    async def weights_info():
        e = engine.engine
        return {"weight_version": e.weight_version, "updates": e.num_weight_updates, "ranks": 1, "asleep": e.asleep,
                "enabled": enabled}

    @app.post("/v1/weights/init_group")
    async def init_group(body: InitGroupRequest, raw: Request):
        admin(raw)
        if body.backend not in BACKENDS:
            raise APIError(400, f"backend must be one of {', '.join(BACKENDS)} (CPU tensors), got {body.backend!r}",
                           param="backend")
        if body.rank_offset >= body.world_size:
            raise APIError(400, f"rank_offset ({body.rank_offset}) must be below world_size ({body.world_size})",
                           param="rank_offset")
        try:
            group = await asyncio.to_thread(groups.join, body.master_address, body.master_port, body.rank_offset,
                                            body.world_size, body.group_name, body.backend, body.timeout_s)
        except ValueError as e:
            raise APIError(400, str(e), param="group_name") from None
        except Exception as e:  # the trainer never came, or its address is wrong
            raise APIError(504, f"could not join group {body.group_name!r} at {body.master_address}:"
                                f"{body.master_port} within {body.timeout_s:g} s ({type(e).__name__})",
                           code="group_timeout") from None
        return {"group_name": group.name, "rank": group.rank, "world_size": group.world_size}

    @app.post("/v1/weights/close_group")
    async def close_group(body: CloseGroupRequest, raw: Request):
        admin(raw)
        if not groups.close(body.group_name):
            raise APIError(404, f"no open group {body.group_name!r}", param="group_name", code="group_not_found")
        return {"group_name": body.group_name, "closed": True}

    @app.post("/v1/weights/update")
    async def update(body: UpdateRequest, raw: Request):
        admin(raw)
        if (body.path is None) == (body.group_name is None):
            raise APIError(400, "give either path (a checkpoint on the server's disk) or group_name (with "
                                "tensors: receive them from the trainer's group)", param="path")
        t0 = time.perf_counter()
        if body.path is not None:
            try:
                named = await asyncio.to_thread(read_weights, body.path, engine.engine.dtype)
            except (ValueError, OSError) as e:
                raise APIError(400, f"could not read weights from {body.path!r}: {e}", param="path") from None
        else:
            if body.group_name not in groups.groups:
                raise APIError(404, f"no open group {body.group_name!r}: POST /v1/weights/init_group first",
                               param="group_name", code="group_not_found")
            try:
                named = await asyncio.to_thread(groups.receive, body.group_name, body.tensors)
            except ValueError as e:
                raise APIError(400, str(e), param="tensors") from None
            except RuntimeError as e:
                raise APIError(502, f"receiving from group {body.group_name!r} failed ({e}); close and reopen it",
                               code="group_failed") from None
        version = body.weight_version
        try:
            n = await engine.call(lambda e: e.update_weights(named, version))
        except ValueError as e:
            raise APIError(400, f"weight update refused, nothing changed: {e}", param="tensors") from None
        return observed({"weight_version": engine.engine.weight_version, "tensors": n,
                         "seconds": round(time.perf_counter() - t0, 3)})

    @app.post("/sleep")
    async def sleep(raw: Request):
        admin(raw)
        try:
            freed = await engine.call(lambda e: e.sleep())
        except EngineBusyError as e:
            raise APIError(409, str(e), code="busy") from None
        return observed({"is_sleeping": True, "freed_bytes": freed})

    @app.post("/wake_up")
    async def wake_up(raw: Request):
        admin(raw)
        await engine.call(lambda e: e.wake_up())
        return observed({"is_sleeping": False})

    @app.get("/is_sleeping")
    async def is_sleeping():
        return {"is_sleeping": engine.engine.asleep}
