"""The engine core in a process of its own (`sluice serve --engine-process`), vLLM V1's shape.

The API server's process keeps FastAPI, tokenization, chat templates, grammar checks and
SSE; the engine-core process runs the scheduler, the runner and the output processor (an
AsyncEngine: its engine thread and its command queue, as in one process). The two talk
over two ZeroMQ PUSH/PULL sockets on IPC paths, every message a msgspec msgpack struct:
a request's sampling parameters travel pickled (once per request), a step's outputs as
typed msgpack deltas (once per step, all of them in one message, each request's new
tokens and text only), so the engine never waits on the server's event loop for the
GIL, and the server never waits on the engine's step.

What crosses, and how the server's guarantees hold across it:
- add / abort: the server's streams, deadlines and keep-alive ticks stay in its process;
  queue-wait bounds, drain and resets run in the core's AsyncEngine as before. A request
  refused by the engine comes back as its ValueError (a 400).
- bounded queues: every Added and Outputs message carries the core's waiting count, which
  with the adds not yet acknowledged is what `--max-waiting` admits against.
- metrics and the dashboard live in the core (its per-step hook observes the engine where
  it runs); /metrics and the dashboard's events ask for them, answered by the core's main
  thread without waiting for a step boundary.
- shutdown: a drain is forwarded, open requests end with the same errors; the server's
  exit stops the core (and a core whose server died exits within a second).
- the core dying (a crash, a kill, the OOM killer) is seen at once through the process's
  sentinel: every open stream ends with EngineDeadError, /health answers 503 and the
  server exits non-zero, as when the engine thread dies in one process.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import pickle
import shutil
import signal
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Callable, Union

import msgspec
import zmq

from sluice.engine.async_engine import (EngineDeadError, EngineState, QueueTimeoutError, RequestFailedError,
                                        RequestTimeoutError, ShuttingDownError, _set_exception, _set_result, iterate)
from sluice.engine.llm_engine import EngineAsleepError, EngineBusyError
from sluice.engine.request_checks import RequestChecks
from sluice.outputs import CompletionOutput, RequestOutput, RequestTimes
from sluice.request import Logprob
from sluice.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 1800.0   # loading a big checkpoint from a slow disk
PARENT_POLL_MS = 1000      # how often an idle core checks that its server still lives


# -- messages -------------------------------------------------------------------------
class ErrorInfo(msgspec.Struct, array_like=True):
    kind: str
    message: str
    retry_after: int = 0


# server -> core
class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt: Union[str, list[int]]
    payload: bytes   # pickle of (SamplingParams, cache_salt, scheduling, queue_wait_s)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Call(msgspec.Struct, tag="call", array_like=True):
    call_id: int     # 0: nobody waits for the result
    name: str
    payload: bytes   # pickle of the arguments


class Drain(msgspec.Struct, tag="drain", array_like=True):
    grace_s: float


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


ToCore = Union[Add, Abort, Call, Drain, Stop]


# core -> server
class Ready(msgspec.Struct, tag="ready", array_like=True):
    payload: bytes   # pickle of what EngineView holds


class LoadFailed(msgspec.Struct, tag="load_failed", array_like=True):
    error: ErrorInfo


class Added(msgspec.Struct, tag="added", array_like=True):
    request_id: str
    prompt_token_ids: Union[list[int], None]
    error: Union[ErrorInfo, None]
    n: int
    waiting: int


class SampleDelta(msgspec.Struct, array_like=True):
    """One sample's news since the request's last message (text, token ids and logprobs
    only grow: held-back text is never shown before it is final)."""
    index: int
    text: str
    token_ids: list[int]
    logprobs: Union[list[dict[int, Logprob]], None]
    finish_reason: Union[str, None]
    stop_reason: Union[int, str, None]


class OutputDelta(msgspec.Struct, array_like=True):
    """A RequestOutput as what changed since the last one sent: its prompt and prompt ids
    in the first only, its prompt logprobs until they are complete. A step's message so
    costs what the step made, not the requests' whole histories."""
    request_id: str
    samples: list[SampleDelta]
    finished: bool
    times: Union[RequestTimes, None]
    num_cached_tokens: int
    error: Union[str, None]
    weight_version: str
    first: bool
    prompt: Union[str, None] = None
    prompt_token_ids: Union[list[int], None] = None
    tenant: str = ""
    prompt_logprobs: Union[list[Union[dict[int, Logprob], None]], None] = None


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[OutputDelta]
    waiting: int


class Ended(msgspec.Struct, tag="ended", array_like=True):
    request_id: str
    error: ErrorInfo


class Result(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    payload: bytes
    error: Union[ErrorInfo, None]


class Dead(msgspec.Struct, tag="dead", array_like=True):
    error: ErrorInfo


FromCore = Union[Ready, LoadFailed, Added, Outputs, Ended, Result, Dead]

# Errors that cross as themselves; anything else arrives as a RuntimeError with its text.
_ERRORS: dict[str, type[BaseException]] = {e.__name__: e for e in (
    ValueError, EngineDeadError, ShuttingDownError, RequestFailedError, RequestTimeoutError, EngineAsleepError,
    EngineBusyError)}


def error_info(e: BaseException) -> ErrorInfo:
    return ErrorInfo(type(e).__name__, str(e), getattr(e, "retry_after", 0))


def rebuild_error(info: ErrorInfo) -> BaseException:
    if info.kind == "QueueTimeoutError":
        return QueueTimeoutError(info.message, info.retry_after)
    return _ERRORS.get(info.kind, RuntimeError)(info.message)


# -- the core's side --------------------------------------------------------------------
class _Sender:
    """The core's output socket, shared by its main thread and its engine thread."""

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.encoder = msgspec.msgpack.Encoder()
        self.lock = threading.Lock()

    def send(self, msg) -> None:
        data = self.encoder.encode(msg)
        with self.lock:
            self.socket.send(data, copy=False)


class _CoreStream:
    """A request's stream as the core's AsyncEngine sees it (its `sink` sends)."""
    __slots__ = ("sink", "request_id")

    def __init__(self, sink: "_CoreSink", request_id: str):
        self.sink, self.request_id = sink, request_id

    def put(self, item) -> None:
        self.sink.put(self, item)


class _CoreSink:
    """What the core's engine thread delivers, sent to the server: a step's outputs in one
    message (as deltas), a request's end by error, a request's admission, a call's result."""

    def __init__(self, sender: _Sender, engine):
        self.sender, self.engine = sender, engine
        # Per open request: each sample's (text, token ids, logprobs) lengths already sent,
        # and whether its complete prompt logprobs went. Touched by the engine thread only.
        self._sent: dict[str, list[tuple[int, int, int]]] = {}
        self._prompt_done: set[str] = set()

    def put(self, stream: _CoreStream, item) -> None:
        if isinstance(item, BaseException):
            self._forget(stream.request_id)
            self.sender.send(Ended(stream.request_id, error_info(item)))
        else:
            self.sender.send(Outputs([self._delta(item)], self.engine.num_waiting_seqs))

    def deliver(self, items) -> None:
        self.sender.send(Outputs([self._delta(out) for _, out in items], self.engine.num_waiting_seqs))

    def _forget(self, rid: str) -> None:
        self._sent.pop(rid, None)
        self._prompt_done.discard(rid)

    def _delta(self, out: RequestOutput) -> OutputDelta:
        rid = out.request_id
        sent = self._sent.get(rid)
        first = sent is None
        if first:
            sent = self._sent[rid] = [(0, 0, 0)] * len(out.outputs)
        samples = []
        for i, c in enumerate(out.outputs):
            t, k, n = sent[i]
            lp = c.logprobs
            samples.append(SampleDelta(c.index, c.text[t:], c.token_ids[k:], None if lp is None else lp[n:],
                                       c.finish_reason, c.stop_reason))
            sent[i] = (len(c.text), len(c.token_ids), 0 if lp is None else len(lp))
        pl = out.prompt_logprobs
        if pl is not None and rid not in self._prompt_done:
            if all(e is not None for e in pl[1:]):
                self._prompt_done.add(rid)
        else:
            pl = None
        if out.finished:
            self._forget(rid)
        return OutputDelta(rid, samples, out.finished, out.times, out.num_cached_tokens, out.error,
                           out.weight_version, first, out.prompt if first else None,
                           out.prompt_token_ids if first else None, out.tenant if first else "", pl)

    def settle(self, token, value=None, error: BaseException | None = None) -> None:
        kind, key, n = token
        if kind == "add":
            ids = None if error is not None else list(value)
            self.sender.send(Added(key, ids, None if error is None else error_info(error), n,
                                   self.engine.num_waiting_seqs))
        elif key:  # a call someone waits for
            self.sender.send(Result(key, b"" if error is not None else pickle.dumps(value),
                                    None if error is None else error_info(error)))


class _Refused:
    """The server's count of requests its tenants' rate limits refused, for the core's
    Metrics.render (quotas live with the HTTP server)."""

    def __init__(self, counts: dict):
        self.counts = counts

    def refused(self) -> dict:
        return self.counts


def view_info(engine) -> dict:
    """What the API server needs of the engine, taken once when the core is ready."""
    grammars = engine.grammars
    return {"tokenizer": engine.tokenizer, "reasoning": engine.reasoning, "max_model_len": engine.max_model_len,
            "model_path": engine.model_path, "vocab_size": engine.runner.vocab_size, "dtype": engine.dtype,
            "checks": engine.request_checks(), "lora_names": engine.lora_names(),
            "grammar": (grammars.vocab_size, grammars.cache_size, grammars.compile_timeout_s),
            "weight_version": engine.weight_version}


def core_main(engine_kwargs: dict, model_name: str, to_core: str, from_core: str, parent_pid: int,
              log_level: str) -> None:
    """The engine-core process: build the engine, then serve the server's commands until it
    says stop or goes away. Nothing of the web server is imported here (its per-step
    metrics hook and the dashboard's view live in modules of their own: ~0.7 s of every
    core's start)."""
    # Ctrl-C at a terminal signals the whole process group: the server drains its streams
    # and then sends Stop, so the core ignores the signal instead of dying under the server
    # mid-shutdown (it goes by itself when the server does: the parent check below).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s core %(name)s: %(message)s")
    from sluice.engine.async_engine import AsyncEngine
    from sluice.engine.llm_engine import LLMEngine
    from sluice.entrypoints.openai.dashboard_view import snapshot
    from sluice.metrics import Metrics, step_hook
    ctx = zmq.Context()
    out = ctx.socket(zmq.PUSH)
    out.connect(from_core)
    inp = ctx.socket(zmq.PULL)
    inp.connect(to_core)
    sender = _Sender(out)
    metrics = Metrics(model_name)

    def on_dead(error: BaseException) -> None:
        sender.send(Dead(ErrorInfo(type(error).__name__, str(error))))

    engine = AsyncEngine(lambda: LLMEngine.from_kwargs(**engine_kwargs), on_step=step_hook(metrics), on_dead=on_dead)
    try:
        engine.start()
    except BaseException as e:
        logger.exception("loading the engine failed")
        sender.send(LoadFailed(error_info(e)))
        out.close(linger=2000)
        inp.close(linger=0)
        ctx.term()
        return
    sender.send(Ready(pickle.dumps(view_info(engine.engine))))
    sink = _CoreSink(sender, engine)
    decoder = msgspec.msgpack.Decoder(ToCore)
    calls = {
        "reset_prefix_cache": lambda e: e.reset_prefix_cache(),
        "release_session": lambda e, sid, tenant: e.release_session(sid, tenant),
    }
    try:
        while True:
            if not inp.poll(PARENT_POLL_MS):
                if os.getppid() != parent_pid:  # the server is gone: nobody reads what we make
                    logger.error("the API server process is gone; the engine core stops")
                    break
                continue
            msg = decoder.decode(inp.recv(copy=False).buffer)
            if isinstance(msg, Add):
                params, salt, scheduling, queue_wait_s = pickle.loads(msg.payload)
                token = ("add", msg.request_id, params.n)
                try:
                    if params.structured_outputs is not None:
                        # Here, not in the engine thread's add_request (a cache hit there):
                        # the server checked it compiles in time.
                        engine.engine.grammars.compile(params.structured_outputs)
                    engine.enqueue(msg.request_id, msg.prompt, params, salt, _CoreStream(sink, msg.request_id),
                                   token, scheduling, queue_wait_s)
                except Exception as e:  # dead, asleep, draining, a grammar: the request's own error
                    sink.settle(token, error=e)
            elif isinstance(msg, Abort):
                engine.abort(msg.request_id)
            elif isinstance(msg, Call):
                args = pickle.loads(msg.payload)
                token = ("call", msg.call_id, 0)
                if msg.name == "render_metrics":
                    metrics.quotas = _Refused(args[0])
                    sink.settle(token, metrics.render())
                elif msg.name == "dashboard":
                    sink.settle(token, snapshot(engine, metrics))
                elif msg.name == "note_tool_calls":
                    engine.note_tool_calls(*args)
                elif msg.name in calls:
                    fn = calls[msg.name]
                    engine.enqueue_call(sink, token, lambda e, fn=fn, args=args: fn(e, *args))
                else:
                    sink.settle(token, error=ValueError(f"the engine core has no call {msg.name!r}"))
            elif isinstance(msg, Drain):
                engine.begin_drain(msg.grace_s)
            elif isinstance(msg, Stop):
                break
    finally:
        engine.shutdown()
        out.close(linger=1000)
        inp.close(linger=0)
        ctx.term()


# -- the server's side ------------------------------------------------------------------
class EngineView:
    """What the API server reads off the engine (`engine.engine` in one process), in the
    server's own process: the tokenizer, the limits, the request checks, and a grammar
    compiler of its own to check grammars before admission."""

    def __init__(self, info: dict):
        from sluice.structured.grammar import GrammarCompiler
        self.tokenizer = info["tokenizer"]
        self.reasoning = info["reasoning"]
        self.max_model_len = info["max_model_len"]
        self.model_path = info["model_path"]
        self.runner = SimpleNamespace(vocab_size=info["vocab_size"])
        self.dtype = info["dtype"]
        self.checks: RequestChecks = info["checks"]
        self._lora_names: dict[str, str] = info["lora_names"]
        self.lora = None  # adapters are fixed at start in this mode (no load / unload routes)
        self.weight_version = info["weight_version"]
        self.num_weight_updates = 0
        self.asleep = False
        vocab, cache_size, timeout = info["grammar"]
        self.grammars = GrammarCompiler(self.tokenizer.hf, self.tokenizer.eos_token_ids, vocab,
                                        cache_size=cache_size, compile_timeout_s=timeout)

    def lora_names(self) -> dict[str, str]:
        return dict(self._lora_names)

    def check_request(self, ids: list[int], params: SamplingParams, lora: str | None = None):
        return self.checks.check(ids, params, lora), None


class EngineCoreClient(EngineState):
    """The API server's handle on an engine-core process: AsyncEngine's interface (submit,
    abort, drain, shutdown, sessions, the waiting count) over the sockets."""

    def __init__(self, engine_kwargs: dict, model_name: str, on_dead: Callable[[BaseException], None] | None = None,
                 log_level: str = "INFO"):
        self.engine_kwargs, self.model_name, self.on_dead, self.log_level = (
            engine_kwargs, model_name, on_dead, log_level)
        self.engine: EngineView | None = None
        self.process: multiprocessing.Process | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._adds: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._outs: dict[str, RequestOutput] = {}   # open requests' outputs so far (reader thread)
        self._next_call = 1
        self._lock = threading.Lock()   # the input socket, the counts below
        self._unqueued = 0              # sequences sent, not yet acknowledged
        self._waiting = 0               # the core's waiting count, as last reported
        self._dead: BaseException | None = None
        self._draining = False
        self._stopping = False
        self._closing = False
        self._dir: str | None = None
        # The output socket is read by a thread until the first request comes, then by
        # that request's event loop (see _attach): _loop set asks the thread to hand it
        # over, _handed says it has (from then on only the loop reads).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed = False

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> None:
        """Start the core and return once its engine is built (or raise what building it
        raised)."""
        self._dir = tempfile.mkdtemp(prefix="sluice-core-")
        self._ctx = zmq.Context()
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._to_core.bind(f"ipc://{self._dir}/in")
        self._from_core = self._ctx.socket(zmq.PULL)
        self._from_core.bind(f"ipc://{self._dir}/out")
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(FromCore)
        # spawn, not fork: this process may already hold torch's threads and CUDA.
        # Not a daemon: the core may start processes of its own (tensor-parallel ranks).
        self.process = multiprocessing.get_context("spawn").Process(
            target=core_main, name="sluice-engine-core",
            args=(self.engine_kwargs, self.model_name, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out",
                  os.getpid(), self.log_level))
        self.process.start()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._from_core.poll(200):
            if not self.process.is_alive():
                self._close()
                raise RuntimeError(f"the engine-core process exited (status {self.process.exitcode}) before "
                                   "its engine was ready; its log is above")
            if time.monotonic() > deadline:
                self.shutdown()
                raise RuntimeError(f"the engine-core process was not ready within {READY_TIMEOUT_S:.0f} s")
        msg = self._decoder.decode(self._from_core.recv())
        if isinstance(msg, LoadFailed):
            self._stopping = True
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()
                self.process.join()
            self._close()
            raise rebuild_error(msg.error)
        self.engine = EngineView(pickle.loads(msg.payload))
        self._reader = threading.Thread(target=self._read, name="sluice-core-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=self._watch, name="sluice-core-watch", daemon=True).start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self.process is None:
            return
        if self.process.is_alive():
            # Without waiting: a PUSH socket whose peer has gone (a core killed or exiting)
            # would block a send forever; join, terminate and kill below end it anyway.
            with contextlib.suppress(zmq.ZMQError, OSError):  # the core may be going already
                self._send(Stop(), zmq.NOBLOCK)
            self.process.join(timeout)
            if self.process.is_alive():
                logger.warning("the engine-core process did not stop in %.0f s; terminating it", timeout)
                self.process.terminate()
                self.process.join(5)
                if self.process.is_alive():
                    self.process.kill()
                    self.process.join()
        self._close()

    def _close(self) -> None:
        # The reader thread owns the output socket once started (a ZeroMQ socket is used by
        # one thread): it sees _closing within a poll and closes it, unless it handed it to
        # the event loop, whose server has stopped by now (shutdown follows uvicorn's run);
        # then the context ends.
        self._closing = True
        reader = getattr(self, "_reader", None)
        if reader is not None and reader is not threading.current_thread():
            reader.join(5)
        if self._handed and not self._loop.is_closed() and not self._loop.is_running():
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._from_core.getsockopt(zmq.FD))
        for sock in (getattr(self, "_to_core", None),
                     getattr(self, "_from_core", None) if reader is None or self._handed else None):
            if sock is not None:
                sock.close(linger=0)
        if getattr(self, "_ctx", None) is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _watch(self) -> None:
        """The core's exit, seen through its sentinel the moment it happens."""
        self.process.join()
        if not self._stopping:
            self._die(EngineDeadError(f"the engine-core process exited unexpectedly (status "
                                      f"{self.process.exitcode})"))

    def _die(self, error: BaseException) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = error
        logger.error("the engine is dead (%s)", error)
        gone = EngineDeadError("the engine stopped; the server is restarting")
        for rid in list(self._streams):
            item = self._streams.pop(rid, None)
            if item is not None:
                item[0].call_soon_threadsafe(item[1].put_nowait, gone)
        for table in (self._adds, self._calls):
            for key in list(table):
                item = table.pop(key, None)
                if item is not None:
                    item[0].call_soon_threadsafe(_set_exception, item[1], gone)
        if self.on_dead is not None:
            self.on_dead(error)

    # -- state ----------------------------------------------------------------------
    @property
    def num_waiting_seqs(self) -> int:
        return self._unqueued + self._waiting

    # -- commands (from the event loop) ---------------------------------------------
    def _send(self, msg, flags: int = 0) -> None:
        data = self._encoder.encode(msg)
        with self._lock:
            self._to_core.send(data, flags, copy=False)

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               cache_salt: str | None = None, deadline: float | None = None,
               keepalive_s: float | None = None, scheduling: dict | None = None,
               queue_wait_s: float | None = None):
        """As AsyncEngine.submit."""
        if self._dead is not None:
            raise EngineDeadError("the engine stopped; the server is restarting")
        if self._draining:
            raise ShuttingDownError("the server is shutting down")
        loop = asyncio.get_running_loop()
        self._attach(loop)
        added: asyncio.Future = loop.create_future()
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, queue)
        self._adds[request_id] = (loop, added)
        with self._lock:
            self._unqueued += params.n
        self._send(Add(request_id, prompt, pickle.dumps((params, cache_salt, scheduling or {}, queue_wait_s))))
        return added, iterate(self, request_id, queue, deadline, keepalive_s)

    def abort(self, request_id: str) -> None:
        if self._dead is None and not self._stopping:
            self._send(Abort(request_id))

    def begin_drain(self, grace_s: float) -> None:
        self._draining = True
        if self._dead is None:
            self._send(Drain(grace_s))

    async def _call(self, name: str, *args):
        if self._dead is not None:
            raise EngineDeadError("the engine stopped; the server is restarting")
        loop = asyncio.get_running_loop()
        self._attach(loop)
        done: asyncio.Future = loop.create_future()
        with self._lock:
            call_id = self._next_call
            self._next_call += 1
        self._calls[call_id] = (loop, done)
        self._send(Call(call_id, name, pickle.dumps(args)))
        return await done

    async def reset_prefix_cache(self) -> int:
        return await self._call("reset_prefix_cache")

    async def release_session(self, session_id: str, tenant: str | None) -> int | None:
        return await self._call("release_session", session_id, tenant)

    def note_tool_calls(self, session_id: str, names: list[str], tenant: str | None) -> None:
        if self._dead is None:
            self._send(Call(0, "note_tool_calls", pickle.dumps((session_id, names, tenant))))

    async def render_metrics(self, metrics) -> bytes:
        """The core's Prometheus text (its Metrics observe the engine where it runs), with
        this server's rate-limit refusals."""
        refused = metrics.quotas.refused() if metrics.quotas is not None else {}
        return await self._call("render_metrics", refused)

    async def dashboard_snapshot(self, metrics) -> dict:
        return await self._call("dashboard")

    async def call(self, fn):
        raise RuntimeError("running a function in the engine is not possible across the engine-core process "
                           "boundary")

    # -- what the core sends (the reader thread) --------------------------------------
    def _apply(self, d: OutputDelta) -> RequestOutput:
        """The request's whole output so far, as the engine made it: the last one sent
        plus this delta (new lists: a consumer may still hold the previous output)."""
        prev = self._outs.get(d.request_id) if not d.first else None
        if prev is None:
            samples = [CompletionOutput(s.index, s.text, s.token_ids, s.finish_reason, s.stop_reason, s.logprobs)
                       for s in d.samples]
            out = RequestOutput(d.request_id, d.prompt, d.prompt_token_ids or [], samples, d.finished, d.times,
                                d.num_cached_tokens, d.prompt_logprobs, d.error, d.tenant, d.weight_version)
        else:
            samples = [CompletionOutput(p.index, p.text + s.text, p.token_ids + s.token_ids, s.finish_reason,
                                        s.stop_reason,
                                        None if s.logprobs is None else (p.logprobs or []) + s.logprobs)
                       for p, s in zip(prev.outputs, d.samples)]
            out = RequestOutput(d.request_id, prev.prompt, prev.prompt_token_ids, samples, d.finished, d.times,
                                d.num_cached_tokens,
                                d.prompt_logprobs if d.prompt_logprobs is not None else prev.prompt_logprobs,
                                d.error, prev.tenant, d.weight_version)
        if d.finished:
            self._outs.pop(d.request_id, None)
        else:
            self._outs[d.request_id] = out
        return out

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Move the reading of the core's messages onto `loop` (the server's event loop, where
        the streams wait), once, at the first request: a reader thread handing every step's
        outputs over with call_soon_threadsafe cost the server a wake-up through the loop's
        self-pipe and a GIL hand-off per message (measured: ~19% of its CPU a token at c1). The
        thread finishes the message it is in, then the loop takes the socket over (a ZeroMQ
        socket is used by one thread at a time)."""
        if self._loop is None:
            self._loop = loop

    def _read(self) -> None:
        sock = self._from_core
        try:
            while not self._closing:
                if self._loop is not None:
                    self._handed = True
                    with contextlib.suppress(RuntimeError):  # a loop already closed: nobody to read for
                        self._loop.call_soon_threadsafe(self._read_on_loop)
                    return
                if sock.poll(50):  # returns as soon as a message is there
                    self._handle(sock.recv(copy=False).buffer)
        finally:
            if not self._handed:
                sock.close(linger=0)

    def _read_on_loop(self) -> None:
        if self._closing:
            return
        self._loop.add_reader(self._from_core.getsockopt(zmq.FD), self._drain)
        self._drain()  # ZeroMQ's descriptor signals edges: what came before is read now

    def _drain(self) -> None:
        """Every message waiting on the output socket, on the event loop."""
        sock = self._from_core
        while not self._closing and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                data = sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(data.buffer)

    def _call_on(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        """fn(*args) on `loop`: at once when this is that loop's thread reading, else handed over."""
        if self._handed and loop is self._loop:
            fn(*args)
        else:
            loop.call_soon_threadsafe(fn, *args)

    def _handle(self, data) -> None:
        """One message from the core (in the reader thread, or on the event loop once the
        first request came): streams and callers are answered on their event loops."""
        try:
            msg = self._decoder.decode(data)
        except msgspec.DecodeError:
            logger.exception("an undecodable message from the engine core")
            return
        call = self._call_on
        if isinstance(msg, Outputs):
            self._waiting = msg.waiting
            batches: dict[asyncio.AbstractEventLoop, list] = {}
            for delta in msg.outputs:
                out = self._apply(delta)
                item = self._streams.pop(out.request_id, None) if out.finished else \
                    self._streams.get(out.request_id)
                if item is not None:
                    batches.setdefault(item[0], []).append((item[1], out))
            for loop, items in batches.items():
                call(loop, _deliver, items)
        elif isinstance(msg, Added):
            with self._lock:
                self._unqueued -= msg.n
                self._waiting = msg.waiting
            item = self._adds.pop(msg.request_id, None)
            if msg.error is not None:
                self._streams.pop(msg.request_id, None)
            if item is not None:
                if msg.error is not None:
                    call(item[0], _set_exception, item[1], rebuild_error(msg.error))
                else:
                    call(item[0], _set_result, item[1], msg.prompt_token_ids)
        elif isinstance(msg, Ended):
            self._outs.pop(msg.request_id, None)
            item = self._streams.pop(msg.request_id, None)
            if item is not None:
                call(item[0], item[1].put_nowait, rebuild_error(msg.error))
        elif isinstance(msg, Result):
            item = self._calls.pop(msg.call_id, None)
            if item is not None:
                if msg.error is not None:
                    call(item[0], _set_exception, item[1], rebuild_error(msg.error))
                else:
                    call(item[0], _set_result, item[1], pickle.loads(msg.payload))
        elif isinstance(msg, Dead):
            self._die(EngineDeadError(f"{msg.error.kind}: {msg.error.message}"))


def _deliver(items: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
