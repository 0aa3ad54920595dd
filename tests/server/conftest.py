"""A real server on 127.0.0.1 and a free port, in this process, over the real engine
on a tiny random Llama (float32)."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from sluice.engine.async_engine import AsyncEngine
from sluice.engine.llm_engine import LLMEngine
from sluice.entrypoints.openai.api_server import ServerConfig, build_app
from sluice.metrics import Metrics, step_hook

MODEL = "tiny-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_process(*args: str, timeout: float = 120, new_session: bool = False) -> tuple[subprocess.Popen, str]:
    """`sluice serve ARGS --port <free>` as a real process (output piped), once its /health
    answers 200: (process, base URL). The caller stops it. new_session: in a process group
    of its own (its id the process's), which a test may signal as a terminal's Ctrl-C does."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "sluice.entrypoints.cli", "serve", *args, "--port", str(port)],
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=new_session)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, f"sluice serve {' '.join(args)} did not come up"
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            proc.kill()
        raise


class RunningServer:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, metrics: Metrics):
        import uvicorn
        config.port = free_port()
        self.url = f"http://127.0.0.1:{config.port}"
        self.engine = engine
        self.server = uvicorn.Server(uvicorn.Config(build_app(engine, config, metrics), host="127.0.0.1",
                                                    port=config.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120  # a hang guard: a start takes seconds, more beside another worker
        while not self.server.started:
            if time.time() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def start_engine(path: str, **kwargs) -> tuple[AsyncEngine, Metrics, dict]:
    engine = LLMEngine.from_kwargs(model=path, dtype="float32", **kwargs)
    metrics = Metrics(MODEL)
    stats = {"max_running": 0, "max_batch_requests": 0}
    record = step_hook(metrics)

    def on_step(eng, outputs, seconds):
        stats["max_running"] = max(stats["max_running"], eng.scheduler.num_running)
        stats["max_batch_requests"] = max(stats["max_batch_requests"], len(outputs))
        record(eng, outputs, seconds)
    aengine = AsyncEngine(engine, on_step=on_step)
    aengine.start()
    return aengine, metrics, stats


@pytest.fixture(scope="session")
def server(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    aengine, metrics, stats = start_engine(path, num_blocks=512)
    main = RunningServer(aengine, ServerConfig(served_model_name=MODEL), metrics)
    keyed = RunningServer(aengine, ServerConfig(served_model_name=MODEL, api_key="sekret"), metrics)
    yield SimpleNamespace(url=main.url, keyed_url=keyed.url, engine=aengine, llm=aengine.engine,
                          metrics=metrics, stats=stats, model_path=path)
    main.stop()
    keyed.stop()
    aengine.shutdown()


@pytest.fixture()
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


class StepGate:
    """Holds a real engine's steps for a test. While shut, the engine thread takes in what
    arrives (requests, aborts) and runs no step, so a crowd meets in the engine at once,
    or a running request stays where it is, however fast or slow this machine runs the
    test: what the test then asserts about the schedule is decided by the requests, not by
    the clock. `open(steps=n)` lets n steps run, then shuts again; `open()` stays open.
    Use it as a context manager (it removes itself, open, at the end)."""

    def __init__(self, aengine: AsyncEngine, shut: bool = True):
        self.aengine, self.engine = aengine, aengine.engine
        self._allowed: int | None = 0 if shut else None   # steps left before it shuts; None: open
        self._has_work = self.engine.has_unfinished_requests
        self._step = self.engine.step
        # The engine loop steps only while the engine has work: shut, it sees none, and
        # sleeps until a command arrives (the instance attributes shadow the methods).
        self.engine.has_unfinished_requests = lambda: self._allowed != 0 and self._has_work()
        self.engine.step = self._counted_step

    def _counted_step(self):
        try:
            return self._step()
        finally:
            if self._allowed:
                self._allowed -= 1

    def shut(self) -> None:
        self._allowed = 0

    def open(self, steps: int | None = None) -> None:
        self._allowed = steps
        self.aengine._wake.set()

    def wait_until(self, condition, what: str, timeout: float = 120.0) -> None:
        """Until condition(engine) holds; a hang guard, far above what any machine needs."""
        deadline = time.monotonic() + timeout
        while not condition(self.engine):
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.005)

    def __enter__(self) -> "StepGate":
        return self

    def __exit__(self, *exc) -> None:
        del self.engine.has_unfinished_requests, self.engine.step
        self.aengine._wake.set()


def wait_all_blocks_free(llm, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if llm.kv.num_free_blocks == llm.kv.num_blocks and not llm.has_unfinished_requests():
            return
        time.sleep(0.01)
    raise AssertionError(f"{llm.kv.num_blocks - llm.kv.num_free_blocks} KV blocks still held")


def metric_value(url: str, name: str, labels: str = "") -> float:
    text = httpx.get(f"{url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name) and labels in line and not line.startswith("#"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
