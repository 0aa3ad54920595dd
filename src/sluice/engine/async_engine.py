"""AsyncEngine: the engine loop in its own thread; one async output stream per request.

The event loop never runs model code. It hands commands (add, abort) to the engine
thread through a queue and reads each request's outputs from an asyncio.Queue that the
engine thread fills with call_soon_threadsafe after every step. A request that arrives
mid-generation joins the batch at the next step; each step's new tokens reach their
streams as soon as the step completes.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from sluice.engine.llm_engine import LLMEngine
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_step: Callable[[LLMEngine, list[RequestOutput], float], None] | None = None):
        """`engine`: an engine, or a function that builds one, which then runs in the engine
        thread. Prefer the function: OpenMP gives every thread that opens a parallel region
        its own worker pool, and a model loaded in one thread and run in another leaves two
        pools on the same cores, where libgomp throttles its spin-waiting (measured: decode
        steps 45% slower). Built in the engine thread, every parallel op runs in one pool."""
        self._factory = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine | None = None if self._factory else engine
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sluice-engine", daemon=True)

    # -- called from the event loop -------------------------------------------
    def start(self) -> None:
        """Start the engine thread; with a factory, return once the engine is built (or
        re-raise what building it raised)."""
        self._thread.start()
        if self._factory is not None:
            self._ready.wait()
            if self._load_error is not None:
                raise self._load_error

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting

    @property
    def num_running(self) -> int:
        return self.engine.scheduler.num_running

    async def reset_prefix_cache(self) -> int:
        """Forget cached prefix blocks, between two engine steps; returns how many."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self._send(("reset", loop, done))
        return await done

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None) -> tuple[list[int], AsyncIterator[RequestOutput]]:
        """Queue a request; returns its prompt token ids and its output stream.
        Raises ValueError (from the engine) if the request can never run."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        self._send(("add", request_id, prompt, params, cache_salt, stream, added))
        try:
            prompt_ids = await added
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller left before its stream existed
            raise
        return prompt_ids, self._iterate(request_id, stream)

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            # The consumer went away (client disconnect, cancellation): stop the request.
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _send(self, command) -> None:
        self._commands.put(command)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------
    def _run(self) -> None:
        if self._factory is not None:
            try:
                self.engine = self._factory()
            except BaseException as e:
                self._load_error = e
                return
            finally:
                self._ready.set()
        engine = self.engine
        try:
            while not self._stop:
                if not engine.has_unfinished_requests() and self._commands.empty():
                    self._wake.wait()
                self._wake.clear()
                self._drain_commands()
                if engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = engine.step()
                    self._dispatch(outputs)
                    if self.on_step is not None:
                        self.on_step(engine, outputs, time.perf_counter() - t0)
        except BaseException as e:  # a bug in the engine: fail every stream, never hang them
            logger.exception("engine loop died")
            self._dead = e
            for stream in self._streams.values():
                stream.put(EngineDeadError(f"engine stopped: {e}"))
            self._streams.clear()
            return
        # Shutting down: end every open stream as aborted.
        for rid in list(self._streams):
            engine.abort(rid)
        self._dispatch(engine.step() if engine.has_unfinished_requests() else [])
        for stream in self._streams.values():
            stream.put(EngineDeadError("server is shutting down"))
        self._streams.clear()

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, salt, stream, added = cmd
                try:
                    ids = self.engine.add_request(rid, prompt, params, cache_salt=salt)
                except Exception as e:  # ValueError for bad input; reported, never fatal
                    stream.loop.call_soon_threadsafe(_set_exception, added, e)
                    continue
                self._streams[rid] = stream
                stream.loop.call_soon_threadsafe(_set_result, added, ids)
            elif cmd[0] == "reset":
                _, loop, done = cmd
                loop.call_soon_threadsafe(_set_result, done, self.engine.reset_prefix_cache())
            elif cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._streams:
                    self.engine.abort(rid)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One call_soon_threadsafe per event loop per step, not one per request: each such
        # call wakes the loop through its self-pipe, and at c32 the 32 wake-ups a step cost
        # as many GIL hand-offs between the engine thread and the server's.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batches.setdefault(stream.loop, []).append((stream.queue, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
