"""Engine replicas as Ray actors: each actor is a whole sluice server (its engine, its
HTTP server) on the node Ray placed it on, restarted by Ray if its process dies.

`ReplicaSet` is the router's view of them: their addresses, which are up, and a monitor
that health-checks them every MONITOR_S and, when one is down, asks Ray for its address
again (a restarted actor comes back on a new port) until it answers. A replica is out of
rotation from the first failed request or health check until it answers again; a
restarted one comes back with the model's original weights, so the router re-applies
the last update from a checkpoint path to it, or keeps it out of rotation (`stale`)
after an update it cannot repeat (one from a trainer's group) until the next update.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import threading
import time

logger = logging.getLogger(__name__)

MONITOR_S = 0.5
HEALTH_TIMEOUT_S = 2.0
START_TIMEOUT_S = 600.0


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Replica:
    """The actor's body (Ray makes it an actor in `actor_class`): builds the engine in its
    thread, serves it over HTTP on its node, answers the router's questions."""

    def __init__(self, index: int, engine_kwargs: dict, server_config, threads: int, driver_ip: str):
        import torch
        torch.set_num_threads(threads)
        logging.basicConfig(level=logging.INFO, format=f"%(levelname)s replica{index} %(name)s: %(message)s")
        import ray
        import uvicorn

        from sluice.engine.async_engine import AsyncEngine
        from sluice.engine.llm_engine import LLMEngine
        from sluice.entrypoints.openai.api_server import build_app
        from sluice.metrics import Metrics, step_hook
        # On the router's node, loopback only; elsewhere the node's address (the router's
        # API keys guard every replica too).
        node_ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if node_ip == driver_ip else node_ip
        port = _free_port(host)
        metrics = Metrics(server_config.served_model_name)

        def on_dead(_error) -> None:  # the engine is gone for good: let Ray restart the process
            os._exit(1)

        self.engine = AsyncEngine(lambda: LLMEngine.from_kwargs(**engine_kwargs), on_step=step_hook(metrics),
                                  on_dead=on_dead)
        self.engine.start()
        app = build_app(self.engine, server_config, metrics)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        threading.Thread(target=self.server.run, name="sluice-http", daemon=True).start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("the replica's HTTP server did not start")
            time.sleep(0.02)
        self.url = f"http://{host}:{port}"

    def address(self) -> str:
        return self.url

    def pid(self) -> int:
        return os.getpid()


def actor_class(ray, replica_cpus: float):
    return ray.remote(Replica).options(max_restarts=-1, max_task_retries=0, num_cpus=replica_cpus,
                                       scheduling_strategy="SPREAD")


class ReplicaSet:
    def __init__(self, ray, n: int, engine_kwargs: dict, server_config, replica_cpus: float, threads: int):
        self.ray = ray
        self.n = n
        driver_ip = ray.util.get_node_ip_address()
        cls = actor_class(ray, replica_cpus)
        # The router holds the tenants' rate limits (so they hold across replicas); a
        # replica keeps only the max_tokens cap, which it applies to each request.
        server_config = dataclasses.replace(server_config, tenants=[
            dataclasses.replace(t, rpm=None, tpm=None, max_concurrency=None) for t in server_config.tenants])
        self.actors = [cls.remote(i, engine_kwargs, server_config, threads, driver_ip) for i in range(n)]
        self.urls: list[str | None] = [None] * n
        self.up = [False] * n
        self.stale = [False] * n    # back from a restart with weights it cannot be given
        self.restarts = [0] * n
        self.on_restart = None      # (replica, url) -> awaitable: the router's re-sync of a restarted one

    async def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Wait for every replica to load its model and serve; raise what a replica's
        constructor raised (a bad model, say)."""
        urls = await asyncio.wait_for(asyncio.gather(*[a.address.remote() for a in self.actors]), timeout)
        for i, url in enumerate(urls):
            self.urls[i], self.up[i] = url, True
            logger.info("replica %d serving at %s", i, url)

    def healthy(self) -> list[int]:
        return [i for i in range(self.n) if self.up[i] and not self.stale[i]]

    def mark_down(self, i: int, why: str) -> None:
        if self.up[i]:
            logger.warning("replica %d is down (%s); out of rotation until it answers again", i, why)
        self.up[i] = False

    async def pid(self, i: int) -> int:
        return await self.actors[i].pid.remote()

    async def monitor(self, client) -> None:
        """Forever: health-check the replicas that are up, find again those that are not."""
        while True:
            await asyncio.gather(*[self._check(client, i) for i in range(self.n)], return_exceptions=True)
            await asyncio.sleep(MONITOR_S)

    async def _check(self, client, i: int) -> None:
        if self.up[i]:
            if not await _healthy(client, self.urls[i]):
                self.mark_down(i, "health check failed")
            return
        try:  # a restarted actor answers once its new server runs; a dead one raises
            url = await asyncio.wait_for(self.actors[i].address.remote(), HEALTH_TIMEOUT_S)
        except Exception:
            return
        if not await _healthy(client, url):
            return
        restarted = url != self.urls[i]
        if restarted and self.on_restart is not None:
            await self.on_restart(i, url)  # if it raises, the next check tries again
        self.restarts[i] += restarted
        self.urls[i] = url
        self.up[i] = True
        logger.warning("replica %d is back at %s%s", i, url, " (stale weights: out of rotation)" if self.stale[i] else "")

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self.ray.kill(a, no_restart=True)
            except Exception:  # already gone
                pass


async def _healthy(client, url: str) -> bool:
    try:
        return (await client.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S)).status_code == 200
    except Exception:
        return False
