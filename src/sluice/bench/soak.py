"""`sluice bench soak`: load and faults against any OpenAI-compatible server.

A seeded plan of requests, run by --concurrency clients until all are done or
--duration runs out: completions and chats, streaming and not, some with n > 1, all with
`ignore_eos` so every answer's token count is known; a share of them disconnect early
(--disconnect-rate) and a share are hostile bodies from a fixed catalogue
(--malformed-rate: bad JSON, NaN, lone surrogates, out-of-range integers, deep nesting,
oversized bodies, wrong types, ...). Then the server's /metrics are read once it is idle.

It reports, as JSON: responses per status, 5xx, connection resets, hangs (no byte for
--hang-timeout seconds), malformed responses (an error that is not OpenAI-shaped, a
stream without [DONE], a body that does not parse), wrong token counts, hostile bodies
that were accepted (2xx), requests still running or waiting and KV blocks still held
after the run (sluice's or vLLM's metric names), and the server's RSS before and after
(--server-pid). The exit status is 1 if any of 5xx, resets, hangs, malformed responses,
wrong token counts or leaks is non-zero.
"""
from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import aiohttp

from sluice.bench.serve import percentile

# Bodies no server should accept, and none should answer with a 5xx. (path, raw bytes);
# "/chat" and "/completions" are under /v1, and MODEL is replaced by the model name.
_DEEP = b"[" * 100_000 + b"]" * 100_000


def _catalogue(model: str, big_bytes: int) -> list[tuple[str, str, bytes]]:
    m = json.dumps(model)

    def cmpl(fields: str) -> bytes:
        return f'{{"model": {m}, {fields}}}'.encode()

    def chat(content: str, extra: str = "") -> bytes:
        return f'{{"model": {m}, "messages": [{{"role": "user", "content": {content}}}]{extra}}}'.encode()
    C, H = "/v1/completions", "/v1/chat/completions"
    return [
        ("truncated_json", C, cmpl('"prompt": "hi", ')[:-3]),
        ("nan_temperature", C, cmpl('"prompt": "hi", "temperature": NaN')),
        ("infinite_temperature", C, cmpl('"prompt": "hi", "temperature": Infinity')),
        ("nan_repetition_penalty", C, cmpl('"prompt": "hi", "repetition_penalty": NaN')),
        ("top_k_past_int64", C, cmpl('"prompt": "hi", "top_k": 9223372036854775808, "temperature": 1')),
        ("huge_n", C, cmpl('"prompt": "hi", "n": 1000, "max_tokens": 4')),
        ("negative_max_tokens", C, cmpl('"prompt": "hi", "max_tokens": -1')),
        ("seed_past_uint64", C, cmpl('"prompt": "hi", "seed": 100000000000000000000000')),
        ("stop_token_past_vocab", C, cmpl('"prompt": "hi", "min_tokens": 2, "stop_token_ids": [999999999]')),
        ("logprobs_1000", C, cmpl('"prompt": "hi", "logprobs": 1000')),
        ("many_stops", C, cmpl('"prompt": "hi", "stop": [' + ", ".join(['"x"'] * 500) + "]")),
        ("surrogate_prompt", C, cmpl('"prompt": "ab\\ud800cd"')),
        ("empty_prompt_list", C, cmpl('"prompt": []')),
        ("mixed_prompt_list", C, cmpl('"prompt": [1, "a"]')),
        ("invalid_utf8", C, cmpl('"prompt": "') + b"\xff\xfe" + b'"}'),
        ("deep_nesting", C, _DEEP),
        ("string_body", C, b'"just a string"'),
        ("empty_body", C, b""),
        ("unknown_model", C, b'{"model": "no-such-model", "prompt": "hi"}'),
        ("oversized_body", C, cmpl('"prompt": "' + "a" * big_bytes + '"')),
        ("null_text_part", H, chat('[{"type": "text", "text": null}]')),
        ("number_text_part", H, chat('[{"type": "text", "text": 5}]')),
        ("image_part", H, chat('[{"type": "image_url", "image_url": {"url": "x"}}]')),
        ("surrogate_message", H, chat('"ab\\ud800cd"')),
        ("messages_not_a_list", H, f'{{"model": {m}, "messages": "hello"}}'.encode()),
        ("role_not_a_string", H, f'{{"model": {m}, "messages": [{{"role": 5, "content": "hi"}}]}}'.encode()),
        ("nan_top_p", H, chat('"hi"', ', "top_p": NaN')),
        ("top_logprobs_1000", H, chat('"hi"', ', "logprobs": true, "top_logprobs": 1000')),
    ]


@dataclass
class Planned:
    kind: str            # completion | chat | malformed
    stream: bool = False
    n: int = 1
    max_tokens: int = 8
    disconnect_after: float | None = None   # seconds, or None to read to the end
    malformed: str | None = None


@dataclass
class SoakReport:
    url: str
    requests_planned: int
    requests_sent: int
    duration_s: float
    statuses: dict[str, int] = field(default_factory=dict)
    by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    server_errors_5xx: int = 0
    connection_resets: int = 0
    hangs: int = 0
    malformed_responses: int = 0
    wrong_token_counts: int = 0
    hostile_accepted: list[str] = field(default_factory=list)
    disconnected: int = 0
    ok: int = 0
    ok_latency_p50_s: float | None = None
    ok_latency_p99_s: float | None = None
    # The worst a client saw: the wait for a stream's first token and for a non-streaming
    # answer's first byte (queue wait plus the prompt), and the longest gap between two
    # chunks of one stream (a stall: preemption, a long prompt beside it).
    worst_first_token_s: float | None = None
    worst_first_byte_s: float | None = None
    worst_stream_gap_s: float | None = None
    after_running: float | None = None
    after_waiting: float | None = None
    after_kv_blocks_used: float | None = None
    leaked: bool = False
    rss_before_mib: float | None = None
    rss_after_mib: float | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return bool(self.server_errors_5xx or self.connection_resets or self.hangs or self.malformed_responses
                    or self.wrong_token_counts or self.leaked)


def make_plan(n: int, seed: int, disconnect_rate: float, malformed_rate: float, max_tokens: int,
              catalogue: list[str]) -> list[Planned]:
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        r = rng.random()
        if r < malformed_rate:
            plan.append(Planned("malformed", malformed=rng.choice(catalogue)))
            continue
        p = Planned(rng.choice(("completion", "chat")), stream=rng.random() < 0.5,
                    n=2 if rng.random() < 0.1 else 1, max_tokens=rng.randint(1, max_tokens))
        if rng.random() < disconnect_rate / max(1e-9, 1 - malformed_rate):
            p.disconnect_after = rng.uniform(0.0, 0.5)
        plan.append(p)
    return plan


_WORDS = ("river stone market engine window garden silver theory quiet number paper storm lantern orbit "
          "velvet harbor signal copper meadow riddle").split()


def _text(rng: random.Random) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 40)))


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


# Engine gauges after the run, by the names sluice and vLLM use.
_GAUGES = {"running": ("sluice_num_requests_running", "vllm:num_requests_running"),
           "waiting": ("sluice_num_requests_waiting", "vllm:num_requests_waiting"),
           "kv_used": ("sluice_kv_cache_blocks_used", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")}


def read_gauges(text: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = re.split(r"[{ ]", line, 1)[0]
        for key, names in _GAUGES.items():
            if name in names:
                found[key] = found.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


class _Run:
    def __init__(self, args, report: SoakReport, catalogue: dict[str, tuple[str, bytes]]):
        self.args = args
        self.report = report
        self.catalogue = catalogue
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.latencies: list[float] = []
        self.kinds: dict[str, Counter] = {}
        self.backoff = 0.0

    def count(self, kind: str, outcome: str) -> None:
        self.report.statuses[outcome] = self.report.statuses.get(outcome, 0) + 1
        self.kinds.setdefault(kind, Counter())[outcome] += 1

    def problem(self, what: str) -> None:
        if len(self.report.problems) < 50:
            self.report.problems.append(what)

    async def one(self, session: aiohttp.ClientSession, p: Planned, rng: random.Random) -> float:
        """Run one planned request; returns the seconds to back off after it (a 429's Retry-After)."""
        label = p.malformed or f"{p.kind}{'-stream' if p.stream else ''}"
        self.backoff = 0.0
        try:
            if p.kind == "malformed":
                await self.malformed(session, p)
            else:
                await self.normal(session, p, rng, label)
        except asyncio.TimeoutError:
            self.report.hangs += 1
            self.count(label, "hang")
            self.problem(f"{label}: no byte for {self.args.hang_timeout:g} s")
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, ConnectionError) as e:
            self.report.connection_resets += 1
            self.count(label, "reset")
            self.problem(f"{label}: connection error {type(e).__name__}: {e}")
        return self.backoff

    async def malformed(self, session: aiohttp.ClientSession, p: Planned) -> None:
        path, body = self.catalogue[p.malformed]
        async with session.post(f"{self.args.url}{path}", data=body,
                                headers={**self.headers, "Content-Type": "application/json"}) as r:
            raw = await r.read()
            self.count(p.malformed, str(r.status))
            if r.status >= 500:
                self.report.server_errors_5xx += 1
                self.problem(f"{p.malformed}: HTTP {r.status}: {raw[:200]!r}")
            elif r.status < 300:
                self.report.hostile_accepted.append(p.malformed)
            elif not _is_openai_error(raw):
                self.report.malformed_responses += 1
                self.problem(f"{p.malformed}: HTTP {r.status} without an OpenAI error body: {raw[:200]!r}")

    async def normal(self, session: aiohttp.ClientSession, p: Planned, rng: random.Random, label: str) -> None:
        chat = p.kind == "chat"
        body = {"model": self.args.model, "max_tokens": p.max_tokens, "n": p.n, "ignore_eos": True,
                "temperature": rng.choice((0.0, 0.8)), "stream": p.stream}
        if chat:
            body["messages"] = [{"role": "user", "content": _text(rng)}]
        else:
            body["prompt"] = _text(rng)
        if p.stream:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions" if chat else "/v1/completions"
        t0 = time.perf_counter()
        work = self.exchange(session, path, body, p, label)
        if p.disconnect_after is not None:
            try:
                await asyncio.wait_for(work, p.disconnect_after)
            except asyncio.TimeoutError:
                self.report.disconnected += 1
                self.count(label, "client_left")
                return
        else:
            await work
            self.latencies.append(time.perf_counter() - t0)

    async def exchange(self, session, path: str, body: dict, p: Planned, label: str) -> None:
        t0 = time.perf_counter()
        async with session.post(f"{self.args.url}{path}", json=body, headers=self.headers) as r:
            status = r.status
            if not p.stream:
                self._worst("worst_first_byte_s", time.perf_counter() - t0)
            if status != 200:
                raw = await r.read()
                self.count(label, str(status))
                if status == 429:  # as a polite client would: wait what Retry-After says (at most 2 s)
                    try:
                        self.backoff = min(2.0, float(r.headers.get("Retry-After", "1")))
                    except ValueError:
                        self.backoff = 1.0
                if status >= 500:
                    self.report.server_errors_5xx += 1
                    self.problem(f"{label}: HTTP {status}: {raw[:200]!r}")
                elif not _is_openai_error(raw):
                    self.report.malformed_responses += 1
                    self.problem(f"{label}: HTTP {status} without an OpenAI error body: {raw[:200]!r}")
                return
            if p.stream:
                tokens = await self.read_stream(r, label, t0)
            else:
                raw = await r.read()
                try:
                    data = json.loads(raw)
                    tokens = data["usage"]["completion_tokens"]
                    assert len(data["choices"]) == p.n
                except (ValueError, KeyError, TypeError, AssertionError):
                    self.report.malformed_responses += 1
                    self.problem(f"{label}: unparseable 200 body {raw[:200]!r}")
                    self.count(label, "200")
                    return
        self.count(label, "200")
        if tokens is None:
            return
        if tokens != p.n * p.max_tokens:
            self.report.wrong_token_counts += 1
            self.problem(f"{label}: {tokens} completion tokens, expected {p.n} x {p.max_tokens}")
        else:
            self.report.ok += 1

    def _worst(self, name: str, seconds: float) -> None:
        current = getattr(self.report, name)
        if current is None or seconds > current:
            setattr(self.report, name, round(seconds, 3))

    async def read_stream(self, r, label: str, t0: float) -> int | None:
        """Completion tokens from the usage chunk, or None after an error event; counts
        a stream that ends without [DONE] or with a line that does not parse; notes the
        wait for its first chunk and its longest gap between chunks."""
        tokens, done, errored = None, False, False
        last = None
        async for raw_line in r.content:
            line = raw_line.decode("utf-8", "replace").strip()
            if not line or line.startswith(":"):
                continue
            now = time.perf_counter()
            if last is None:
                self._worst("worst_first_token_s", now - t0)
            else:
                self._worst("worst_stream_gap_s", now - last)
            last = now
            if not line.startswith("data: "):
                self.report.malformed_responses += 1
                self.problem(f"{label}: stream line {line[:120]!r}")
                return None
            payload = line[6:]
            if payload == "[DONE]":
                done = True
                break
            try:
                data = json.loads(payload)
            except ValueError:
                self.report.malformed_responses += 1
                self.problem(f"{label}: stream data {payload[:120]!r}")
                return None
            if "error" in data:
                errored = True
                status = str(data["error"].get("code") or "error")
                self.count(label, f"stream_error:{status}")
                if data["error"].get("type") == "internal_server_error":
                    self.report.server_errors_5xx += 1
                    self.problem(f"{label}: stream error {data['error']}")
            elif data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
        if not done:
            self.report.malformed_responses += 1
            self.problem(f"{label}: stream ended without [DONE]")
            return None
        return None if errored else tokens


def _is_openai_error(raw: bytes) -> bool:
    try:
        err = json.loads(raw)["error"]
        return isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
    except (ValueError, KeyError, TypeError):
        return False


async def soak(args) -> SoakReport:
    catalogue = {name: (path, body) for name, path, body in _catalogue(args.model, args.big_body_bytes)}
    plan = make_plan(args.requests, args.seed, args.disconnect_rate, args.malformed_rate, args.max_tokens,
                     sorted(catalogue))
    report = SoakReport(url=args.url, requests_planned=len(plan), requests_sent=0, duration_s=0.0,
                        rss_before_mib=rss_mib(args.server_pid))
    run = _Run(args, report, catalogue)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.hang_timeout, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=args.concurrency + 8)
    t0 = time.perf_counter()
    end = t0 + args.duration
    queue: asyncio.Queue = asyncio.Queue()
    for i, p in enumerate(plan):
        queue.put_nowait((i, p))

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async def worker():
            while time.perf_counter() < end:
                try:
                    i, p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                report.requests_sent += 1
                backoff = await run.one(session, p, random.Random(args.seed * 1_000_003 + i))
                if backoff:
                    await asyncio.sleep(backoff)
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        report.duration_s = time.perf_counter() - t0
        # Idle now: the engine should hold nothing. Give aborts and finishes a moment to land.
        gauges: dict[str, float] = {}
        deadline = time.perf_counter() + args.settle
        while True:
            try:
                async with session.get(f"{args.url}/metrics", headers=run.headers) as r:
                    gauges = read_gauges(await r.text()) if r.status == 200 else {}
            except aiohttp.ClientError:
                gauges = {}
            if not any(gauges.values()) or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.25)
    report.after_running = gauges.get("running")
    report.after_waiting = gauges.get("waiting")
    report.after_kv_blocks_used = gauges.get("kv_used")
    report.leaked = any(gauges.get(k) for k in ("running", "waiting", "kv_used"))
    report.rss_after_mib = rss_mib(args.server_pid)
    report.ok_latency_p50_s = percentile(run.latencies, 0.5)
    report.ok_latency_p99_s = percentile(run.latencies, 0.99)
    report.by_kind = {k: dict(v) for k, v in sorted(run.kinds.items())}
    return report


def run(args) -> int:
    report = asyncio.run(soak(args))
    out = asdict(report)
    out["failed"] = report.failed
    text = json.dumps(out, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    print(text)
    return 1 if report.failed else 0


def add_parser(sub) -> None:
    p = sub.add_parser("soak", help="load and faults against an OpenAI-compatible server; reports what broke")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m", help="model name to send in requests")
    p.add_argument("--api-key", default=None)
    p.add_argument("--requests", type=int, default=1000, help="requests in the plan (default 1000)")
    p.add_argument("--concurrency", type=int, default=64,
                   help="clients at once; twice the server's running capacity is a fair overload (default 64)")
    p.add_argument("--duration", type=float, default=600.0, help="stop sending after this many seconds (default 600)")
    p.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a request (default 32)")
    p.add_argument("--disconnect-rate", type=float, default=0.1, help="share of requests that leave early")
    p.add_argument("--malformed-rate", type=float, default=0.15, help="share of requests that are hostile bodies")
    p.add_argument("--big-body-bytes", type=int, default=5 * 2**20,
                   help="size of the oversized-body probe (default 5 MiB, past sluice's 4 MiB limit)")
    p.add_argument("--hang-timeout", type=float, default=120.0,
                   help="seconds without a byte after which a request counts as hung (default 120)")
    p.add_argument("--settle", type=float, default=10.0,
                   help="seconds to wait, after the last request, for the engine to report itself idle")
    p.add_argument("--server-pid", type=int, default=None, help="the server's pid, for RSS before and after")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    p.set_defaults(func=run)
