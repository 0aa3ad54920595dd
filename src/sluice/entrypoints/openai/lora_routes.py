"""LoRA adapters at run time: vLLM's two routes.

    POST /v1/load_lora_adapter    {"lora_name": ..., "lora_path": ...}  (a PEFT folder on the
                                  server's disk) -> 200 "Success: LoRA adapter 'NAME' added
                                  successfully."; 400 naming what does not fit the model
    POST /v1/unload_lora_adapter  {"lora_name": ...} -> 200; 404 for an unknown name

Off unless the server runs with --enable-lora-updates (404 saying so); with API keys they
take the server's own --api-key only. The folder is read and checked off the engine thread
(generation goes on); the engine takes the adapter between two steps. An adapter that fails
any check changes nothing; unloading lets requests already running with it finish.
"""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from sluice.engine.async_engine import AsyncEngine
from sluice.entrypoints.openai.errors import APIError
from sluice.entrypoints.openai.weights import admin_guard
from sluice.lora.adapters import MAX_NAME_CHARS
from sluice.metrics import Metrics


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_int_id: int | None = None  # vLLM's clients may send it; names are what count here


def add_lora_routes(app: FastAPI, engine: AsyncEngine, enabled: bool, base_model: str, admin_key: str | None,
                    keys: dict[bytes, tuple[str, str]], metrics: Metrics) -> None:
    admin = admin_guard(enabled, "--enable-lora-updates", "lora_updates_disabled", "LoRA adapter routes",
                        admin_key, keys)

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoRARequest, raw: Request):
        admin(raw)
        if engine.engine.lora is None:
            raise APIError(400, "this server serves no LoRA adapters: start it with --enable-lora or --lora-modules",
                           param="lora_name")
        if body.lora_name == base_model:
            raise APIError(400, f"{body.lora_name!r} is the base model's name", param="lora_name")
        if body.lora_name in engine.engine.lora_names():
            raise APIError(400, f"a LoRA adapter named {body.lora_name!r} is already loaded", param="lora_name")
        try:
            adapter = await asyncio.to_thread(engine.engine.read_lora, body.lora_name, body.lora_path)
            await engine.call(lambda e: e.load_lora(adapter))
        except ValueError as e:
            raise APIError(400, str(e), param="lora_path") from None
        metrics.set_lora_loaded(len(engine.engine.lora_names()))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoRARequest, raw: Request):
        admin(raw)
        try:
            await engine.call(lambda e: e.unload_lora(body.lora_name))
        except ValueError as e:
            raise APIError(404, str(e), param="lora_name", code="lora_not_found") from None
        metrics.set_lora_loaded(len(engine.engine.lora_names()))
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
