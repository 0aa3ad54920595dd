"""AsyncEngine: the engine loop in its own thread; one async output stream per request.

The event loop never runs model code. It hands commands (add, abort) to the engine
thread through a queue and reads each request's outputs from an asyncio.Queue that the
engine thread fills with call_soon_threadsafe after every step. A request that arrives
mid-generation joins the batch at the next step; each step's new tokens reach their
streams as soon as the step completes.

Failures never leave a stream hanging or the server answering 503 for good:
- a step that raises ends its own requests with an error (LLMEngine.step) and the loop
  goes on;
- a step that cannot run at all (EngineFatalError: a tensor-parallel rank is gone) ends
  every request in flight and the engine is declared dead at once;
- if the loop itself dies (a failure outside a step), every request in flight ends with
  RequestFailedError at once and the engine is reset (its queues and cache rebuilt, the
  model kept: milliseconds); after MAX_RESETS deaths within RESET_WINDOW_S, or if the
  reset fails, the engine is declared dead and `on_dead` is called (the server then exits
  non-zero, for a supervisor to restart it).
"""
from __future__ import annotations

import asyncio
import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from sluice.engine.llm_engine import EngineAsleepError, EngineFatalError, LLMEngine
from sluice.outputs import RequestOutput
from sluice.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_RESETS = 3
RESET_WINDOW_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine is gone for good (its loop died and could not be reset)."""


class ShuttingDownError(RuntimeError):
    """The server is stopping: no new requests, and open ones end at the grace deadline."""


class RequestFailedError(RuntimeError):
    """This request was ended by a failure inside the engine; the engine goes on."""


class QueueTimeoutError(RuntimeError):
    """The request could not start within its queue-wait bound; it was dropped before
    running. retry_after: seconds until the queue ahead of it is likely to have drained."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeoutError(RuntimeError):
    """The request passed its deadline; it was aborted."""


_KEEPALIVE = object()   # a stream's timer tick: nothing came for keepalive_s
_DEADLINE = object()    # its deadline passed


class LoopSink:
    """Where the engine thread delivers to streams and callers on one asyncio event loop:
    everything goes through call_soon_threadsafe. The engine-core process
    (engine/core_process.py) has a sink of its own that sends the same over a socket."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop

    def put(self, stream: "_Stream", item) -> None:
        self.loop.call_soon_threadsafe(stream.queue.put_nowait, item)

    def deliver(self, items: list[tuple["_Stream", RequestOutput]]) -> None:
        self.loop.call_soon_threadsafe(_deliver, items)

    def settle(self, token: asyncio.Future, value=None, error: BaseException | None = None) -> None:
        """A caller's answer: a request's prompt ids when added, or a call's result."""
        if error is not None:
            self.loop.call_soon_threadsafe(_set_exception, token, error)
        else:
            self.loop.call_soon_threadsafe(_set_result, token, value)


@dataclass(eq=False)
class _Stream:
    sink: LoopSink
    queue: asyncio.Queue

    def put(self, item) -> None:
        self.sink.put(self, item)


class _Timers:
    """A stream's deadline and keep-alive ticks, as loop timers that drop sentinels into
    its queue: nothing per output, one callback per keepalive_s of silence."""

    def __init__(self, q: asyncio.Queue, deadline: float | None, keepalive_s: float | None):
        loop = asyncio.get_running_loop()
        self.q, self.keepalive_s, self.items = q, keepalive_s, 0
        self.handles = []
        if deadline is not None:
            self.handles.append(loop.call_at(deadline, q.put_nowait, _DEADLINE))
        if keepalive_s is not None:
            self.seen = 0
            self.handles.append(loop.call_later(keepalive_s, self._tick))

    def _tick(self) -> None:
        if self.items == self.seen:
            self.q.put_nowait(_KEEPALIVE)
        self.seen = self.items
        self.handles.append(asyncio.get_running_loop().call_later(self.keepalive_s, self._tick))

    def cancel(self) -> None:
        for h in self.handles:
            h.cancel()


async def iterate(engine, request_id: str, queue: asyncio.Queue, deadline: float | None = None,
                  keepalive_s: float | None = None) -> AsyncIterator[RequestOutput | None]:
    """A request's outputs as its queue receives them (RequestOutput, or an exception the
    engine ended it with), with its deadline and keep-alive ticks; a consumer that leaves
    early aborts it (engine.abort: an AsyncEngine or the engine-core process's client)."""
    finished = False
    timers = _Timers(queue, deadline, keepalive_s)
    try:
        while True:
            item = await queue.get()
            if item is _KEEPALIVE:
                yield None
                continue
            timers.items += 1
            if item is _DEADLINE:
                raise RequestTimeoutError("the request did not finish by its deadline (--request-timeout); "
                                          "it was ended and its blocks freed")
            if isinstance(item, BaseException):
                finished = True  # the engine has already let it go
                raise item
            finished = item.finished
            if item.error is not None:
                raise RequestFailedError(item.error)
            yield item
            if finished:
                return
    finally:
        timers.cancel()
        # The consumer went away (client disconnect, cancellation) or the deadline
        # passed: stop the request.
        if not finished:
            engine.abort(request_id)


class EngineState:
    """Dead (gone for good) and accepting (neither dead nor draining), as the server asks
    them of an AsyncEngine or of the engine-core process's client."""
    _dead: BaseException | None = None
    _draining: bool = False

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def accepting(self) -> bool:
        return self._dead is None and not self._draining


class AsyncEngine(EngineState):
    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine],
                 on_step: Callable[[LLMEngine, list[RequestOutput], float], None] | None = None,
                 on_dead: Callable[[BaseException], None] | None = None):
        """`engine`: an engine, or a function that builds one, which then runs in the engine
        thread. Prefer the function: OpenMP gives every thread that opens a parallel region
        its own worker pool, and a model loaded in one thread and run in another leaves two
        pools on the same cores, where libgomp throttles its spin-waiting (measured: decode
        steps 45% slower). Built in the engine thread, every parallel op runs in one pool.
        `on_dead` is called (from the engine thread) if the engine dies for good."""
        self._factory = None if isinstance(engine, LLMEngine) else engine
        self.engine: LLMEngine | None = None if self._factory else engine
        self._ready = threading.Event()
        self._load_error: BaseException | None = None
        self.on_step = on_step
        self.on_dead = on_dead
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._sinks: dict[asyncio.AbstractEventLoop, LoopSink] = {}
        self._stop = False
        self._dead: BaseException | None = None
        # Guards what both threads change: the sequences sent but not yet queued by the
        # engine thread, and the dead / draining state.
        self._lock = threading.Lock()
        self._unqueued = 0
        self._draining = False
        self._drain_deadline: float | None = None
        # Requests with a queue-wait bound, not yet started: request id -> (monotonic time by
        # which it must have been scheduled, the bound in seconds).
        self._queue_deadlines: dict[str, tuple[float, float]] = {}
        # When requests finished (the last minute's): the drain rate a refused request's
        # Retry-After is estimated from.
        self._finish_times: deque[float] = deque()
        self.num_resets = 0
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
    def num_waiting_seqs(self) -> int:
        """Sequences waiting for a seat: queued in the scheduler, plus those sent to the
        engine thread that it has not queued yet (so back-to-back admissions count each
        other at once, not a step later)."""
        return self._unqueued + self.engine.scheduler.num_waiting

    async def reset_prefix_cache(self) -> int:
        """Forget cached prefix blocks, between two engine steps; returns how many."""
        return await self.call(lambda e: e.reset_prefix_cache())

    async def call(self, fn):
        """Run fn(engine) in the engine thread between two steps (a weight update, sleep, a
        cache reset): its result, or what it raised."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        self.enqueue_call(self._sink(loop), done, fn)
        return await done

    def _sink(self, loop: asyncio.AbstractEventLoop) -> LoopSink:
        """One sink per event loop, so that a step's outputs for that loop go in one call."""
        sink = self._sinks.get(loop)
        if sink is None:
            sink = self._sinks[loop] = LoopSink(loop)
        return sink

    def enqueue_call(self, sink, token, fn) -> None:
        """Run fn(engine) between two steps; its result or error goes to sink.settle(token)."""
        self._send(("call", sink, token, fn))

    async def render_metrics(self, metrics) -> bytes:
        """/metrics: the Prometheus text of `metrics`, which this process's per-step hook
        fills (the engine-core process's client asks that process instead)."""
        return metrics.render()

    async def release_session(self, session_id: str, tenant: str | None) -> int | None:
        """Drop a session's pinned blocks, between two engine steps; how many, or None
        if the tenant has no such session."""
        return await self.call(lambda e: e.release_session(session_id, tenant))

    def note_tool_calls(self, session_id: str, names: list[str], tenant: str | None) -> None:
        """A session's call ended by calling these tools (its pin's TTL follows them); sent
        to the engine thread without waiting for it: the response is not held for it."""
        self._send(("note", lambda e: e.session_tool_called(session_id, names, tenant)))

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               cache_salt: str | None = None, deadline: float | None = None,
               keepalive_s: float | None = None, scheduling: dict | None = None,
               queue_wait_s: float | None = None
               ) -> tuple[asyncio.Future, AsyncIterator[RequestOutput | None]]:
        """Send a request to the engine thread now (no await: an admission check just
        before it sees it counted). Returns a future of its prompt token ids (it raises
        the engine's ValueError if the request can never run) and its output stream.
        At `deadline` (event-loop time) the stream raises RequestTimeoutError and the
        request is aborted; with `keepalive_s`, the stream yields None after every
        keepalive_s without an output. scheduling: session_id, tenant and priority
        (LLMEngine.add_request). queue_wait_s: a request not scheduled that long after
        it reached the engine is dropped, and its stream raises QueueTimeoutError."""
        loop = asyncio.get_running_loop()
        added: asyncio.Future = loop.create_future()
        stream = _Stream(self._sink(loop), asyncio.Queue())
        self.enqueue(request_id, prompt, params, cache_salt, stream, added, scheduling, queue_wait_s)
        return added, iterate(self, request_id, stream.queue, deadline, keepalive_s)

    def enqueue(self, request_id: str, prompt: str | list[int], params: SamplingParams, cache_salt: str | None,
                stream: _Stream, added, scheduling: dict | None = None, queue_wait_s: float | None = None) -> None:
        """Hand a request to the engine thread: its outputs go to stream.put / its sink's
        deliver, its prompt ids (or the ValueError that refused it) to sink.settle(added).
        Raises at once if the engine takes nothing now."""
        with self._lock:
            if self._dead is not None:
                raise EngineDeadError("the engine stopped; the server is restarting")
            if self.engine.asleep:
                raise EngineAsleepError("the engine is asleep (its KV cache is freed): POST /wake_up first")
            if self._draining:
                raise ShuttingDownError("the server is shutting down")
            self._unqueued += params.n
            self._send(("add", request_id, prompt, params, cache_salt, stream, added, scheduling or {},
                        queue_wait_s))

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def begin_drain(self, grace_s: float) -> None:
        """Stop taking requests; those still open after grace_s end with ShuttingDownError
        (their blocks freed), so every stream can be closed properly before the process exits."""
        with self._lock:
            self._draining = True
            self._drain_deadline = time.monotonic() + grace_s
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self.engine is not None:
            self.engine.shutdown()  # the other tensor-parallel ranks, if any

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
        deaths: deque[float] = deque()
        while True:
            try:
                self._loop()
                break
            except EngineFatalError as e:  # nothing can run (a tensor-parallel rank is gone)
                logger.error("%s", e)
                self._end_streams(RequestFailedError(f"{e} (details in the server log)"))
                self._die(e)
                return
            except Exception as e:  # a bug outside a step: end what is in flight, reset, go on
                now = time.monotonic()
                deaths.append(now)
                while deaths and now - deaths[0] > RESET_WINDOW_S:
                    deaths.popleft()
                fatal = len(deaths) > MAX_RESETS
                logger.exception("the engine loop failed (%s, %d time(s) in the last %.0f s); ending %d request(s) "
                                 "in flight and %s", type(e).__name__, len(deaths), RESET_WINDOW_S,
                                 len(self._streams), "giving up" if fatal else "resetting the engine")
                self._end_streams(RequestFailedError(
                    f"the engine failed while running this request ({type(e).__name__}) and was "
                    f"{'stopped' if fatal else 'reset; the server goes on'} (details in the server log)"))
                if fatal:
                    self._die(e)
                    return
                try:
                    self.engine.reset()
                    self.num_resets += 1
                except Exception as reset_error:
                    logger.exception("resetting the engine failed")
                    self._die(reset_error)
                    return
        # Shutting down: end every open stream, and free its blocks.
        self._end_requests(ShuttingDownError("the server is shutting down"))
        self._drain_commands(refuse=ShuttingDownError("the server is shutting down"))

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop:
            if not engine.has_unfinished_requests() and self._commands.empty():
                # Idle; while draining, wake at the deadline if streams are still open, and
                # at the first queue-wait bound.
                deadlines = [d for d, _ in self._queue_deadlines.values()]
                if self._drain_deadline is not None and self._streams:
                    deadlines.append(self._drain_deadline)
                self._wake.wait(max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)
            self._wake.clear()
            self._drain_commands()
            self._end_drained()
            if self._queue_deadlines:
                self._end_queue_waits()
            if engine.has_unfinished_requests():
                t0 = time.perf_counter()
                outputs = engine.step()
                self._dispatch(outputs)
                if self.on_step is not None:
                    try:
                        self.on_step(engine, outputs, time.perf_counter() - t0)
                    except Exception:  # metrics are not worth a request
                        logger.exception("the per-step hook failed")

    def _end_queue_waits(self) -> None:
        """Drop the requests past their queue-wait bound that have not started (a started
        one leaves the watch list), answering each with a Retry-After from the drain rate:
        the requests waiting over the last minute's finishes per second."""
        now = time.monotonic()
        sched, outputs = self.engine.scheduler, self.engine.outputs
        for rid, (deadline, bound) in list(self._queue_deadlines.items()):
            children = [sched.requests.get(c) for c in outputs.children_of(rid)]
            if not children or any(r is not None and r.first_scheduled_time is not None for r in children):
                del self._queue_deadlines[rid]  # started (or gone)
            elif now >= deadline:
                del self._queue_deadlines[rid]
                while self._finish_times and now - self._finish_times[0] > 60.0:
                    self._finish_times.popleft()
                span = now - self._finish_times[0] if self._finish_times else 0.0
                rate = len(self._finish_times) / span if span > 0 else 0.0
                waiting = sched.num_waiting
                retry = min(60, max(1, math.ceil(waiting / rate))) if rate > 0 else 60
                stream = self._streams.pop(rid, None)
                if stream is not None:
                    stream.put(QueueTimeoutError(
                        f"the server is overloaded: this request could not start within {bound:g} s "
                        f"(--max-queue-wait; {waiting} requests waiting); retry in about {retry} s", retry))
                self.engine.abort(rid)

    def _end_drained(self) -> None:
        deadline = self._drain_deadline
        if deadline is None or time.monotonic() < deadline or not self._streams:
            return
        logger.warning("shutdown grace period over: ending %d open request(s)", len(self._streams))
        self._end_requests(ShuttingDownError("the server is shutting down; the request was ended"))

    def _end_requests(self, error: BaseException) -> None:
        """Every open stream gets `error` (before its abort could reach it as a plain
        finish), and every request is aborted, which frees its blocks at once."""
        rids = list(self._streams)
        self._end_streams(error)
        for rid in rids:
            self.engine.abort(rid)

    def _end_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()

    def _die(self, error: BaseException) -> None:
        with self._lock:
            self._dead = error
        logger.error("the engine is dead (%s: %s)", type(error).__name__, error)
        self._end_streams(EngineDeadError("the engine stopped; the server is restarting"))
        self._drain_commands(refuse=EngineDeadError("the engine stopped; the server is restarting"))
        if self.on_dead is not None:
            self.on_dead(error)

    def _drain_commands(self, refuse: BaseException | None = None) -> None:
        """Run the queued commands; with `refuse`, fail every add and call with it instead
        (the engine is stopping), so that no caller waits forever."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, prompt, params, salt, stream, added, scheduling, queue_wait_s = cmd
                try:
                    if refuse is not None:
                        raise refuse
                    ids = self.engine.add_request(rid, prompt, params, cache_salt=salt, **scheduling)
                except Exception as e:  # ValueError for bad input; reported, never fatal
                    stream.sink.settle(added, error=e)
                    continue
                finally:
                    with self._lock:
                        self._unqueued -= params.n
                self._streams[rid] = stream
                if queue_wait_s is not None:
                    self._queue_deadlines[rid] = (time.monotonic() + queue_wait_s, queue_wait_s)
                stream.sink.settle(added, ids)
            elif cmd[0] == "call":
                _, sink, token, fn = cmd
                if refuse is not None:
                    sink.settle(token, error=refuse)
                    continue
                try:
                    result = fn(self.engine)
                except Exception as e:  # the caller's to report (a bad update, a busy engine)
                    sink.settle(token, error=e)
                else:
                    sink.settle(token, result)
            elif cmd[0] == "note" and refuse is None:
                try:
                    cmd[1](self.engine)
                except Exception:  # a hint lost, nothing more: the TTL falls back to the session's
                    logger.exception("engine note failed")
            elif cmd[0] == "abort" and refuse is None:
                rid = cmd[1]
                if rid in self._streams:
                    self.engine.abort(rid)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        # One call_soon_threadsafe per event loop per step, not one per request: each such
        # call wakes the loop through its self-pipe, and at c32 the 32 wake-ups a step cost
        # as many GIL hand-offs between the engine thread and the server's.
        batches: dict[object, list[tuple[_Stream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            batches.setdefault(stream.sink, []).append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
                self._finish_times.append(time.monotonic())
        for sink, items in batches.items():
            sink.deliver(items)


def _deliver(items: list[tuple[_Stream, RequestOutput]]) -> None:
    for stream, out in items:
        stream.queue.put_nowait(out)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
