"""`sluice bench serve`: load against any OpenAI-compatible server (ours or another engine).

Closed loop (default): for each concurrency c, c clients each send a streaming request,
wait for it to end, and send the next, until --requests are done. Open loop
(--request-rate R): requests arrive as a Poisson process of R per second. Prompts are
windows of real English text from a seeded generator; outputs have a fixed length
(ignore_eos). Reports output tokens/s, TTFT, TPOT and end-to-end latency percentiles as
JSON, and plots throughput and latency against concurrency.

The client runs on aiohttp, whose HTTP parser is C: a load generator shares the machine
with the server it measures, and on 2 cores httpx's pure-Python streaming took about half
a core at 32 clients, throughput the server then lacked (docs/benchmarks.md).
"""
from __future__ import annotations

import asyncio
import functools
import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp


TIMEOUT = aiohttp.ClientTimeout(total=600.0)


@dataclass
class RequestResult:
    ok: bool
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    error: str | None = None
    # Gaps between consecutive streamed chunks after the first (inter-token latency: a
    # step's time, as each request sees it; TPOT is their mean per request).
    itls: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


@dataclass
class RunSummary:
    concurrency: int | None
    request_rate: float | None
    requests: int
    failed: int
    duration_s: float
    output_tok_per_s: float
    requests_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    e2e_p50_s: float | None
    e2e_p99_s: float | None
    errors: list[str] = field(default_factory=list)
    itl_p50_s: float | None = None
    itl_p99_s: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


@dataclass
class Streamed:
    """One streamed /v1/completions call as the client saw it."""
    ok: bool
    e2e: float = 0.0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)   # gaps between text chunks after the first
    chunks: int = 0
    text: str = ""
    usage: dict | None = None
    error: str | None = None


async def stream_completion(client: aiohttp.ClientSession, url: str, body: dict, api_key: str | None) -> Streamed:
    """POST a streaming completion and read its server-sent events to the end."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    r = Streamed(False)
    parts: list[str] = []
    last = None
    try:
        async with client.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                r.error, r.e2e = f"HTTP {resp.status}: {text[:200]}", time.perf_counter() - t0
                return r
            async for raw in resp.content:  # one server-sent-event line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if payload.get("usage"):
                    r.usage = payload["usage"]
                for choice in payload.get("choices", []):
                    if choice.get("text"):
                        r.chunks += 1
                        parts.append(choice["text"])
                        now = time.perf_counter()
                        if r.ttft is None:
                            r.ttft = now - t0
                        else:
                            r.itls.append(now - last)
                        last = now
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        r.error, r.e2e = f"{type(e).__name__}: {e}", time.perf_counter() - t0
        return r
    r.ok, r.text, r.e2e = True, "".join(parts), time.perf_counter() - t0
    return r


async def one_request(client: aiohttp.ClientSession, url: str, model: str, prompt: str, output_len: int,
                      api_key: str | None, extra: dict | None = None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    r = await stream_completion(client, url, body, api_key)
    if not r.ok:
        return RequestResult(False, e2e=r.e2e, error=r.error)
    tokens = (r.usage or {}).get("completion_tokens")
    return RequestResult(True, tokens if tokens is not None else r.chunks, r.ttft, r.e2e, itls=r.itls)


def summarize(results: list[RequestResult], duration: float, concurrency: int | None,
              rate: float | None) -> RunSummary:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    e2es = [r.e2e for r in ok]
    itls = [g for r in ok for g in r.itls]
    return RunSummary(
        concurrency=concurrency, request_rate=rate, requests=len(results), failed=len(results) - len(ok),
        duration_s=duration, output_tok_per_s=tokens / duration if duration else 0.0,
        requests_per_s=len(ok) / duration if duration else 0.0,
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p99_s=percentile(ttfts, 0.99),
        tpot_p50_s=percentile(tpots, 0.5), tpot_p99_s=percentile(tpots, 0.99),
        e2e_p50_s=percentile(e2es, 0.5), e2e_p99_s=percentile(e2es, 0.99),
        errors=sorted({r.error for r in results if r.error})[:5],
        itl_p50_s=percentile(itls, 0.5), itl_p99_s=percentile(itls, 0.99))


async def closed_loop(url, model, prompts, output_len, concurrency, api_key, new_connections=False,
                      extra: dict | None = None) -> RunSummary:
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    results: list[RequestResult] = []
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=new_connections)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as client:
        async def worker():
            while True:
                try:
                    p = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                results.append(await one_request(client, url, model, p, output_len, api_key, extra))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
    return summarize(results, duration, concurrency, None)


async def open_loop(url, model, prompts, output_len, rate, seed, api_key, new_connections=False,
                    extra: dict | None = None) -> RunSummary:
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=1024, force_close=new_connections)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as client:
        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(one_request(client, url, model, p, output_len, api_key, extra)))
            await asyncio.sleep(rng.expovariate(rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    return summarize(results, duration, None, rate)


@functools.lru_cache(maxsize=None)
def _tokenizer(model: str):
    from sluice.models.loader import load_hf_config, resolve_model
    from sluice.tokenizer import Tokenizer
    src = resolve_model(model)
    return Tokenizer.load(src, load_hf_config(src))


def make_text_prompts(tokenizer_model: str, n: int, input_len: int, seed: int) -> list[str]:
    from sluice.bench.workload import make_prompts
    tok = _tokenizer(tokenizer_model)
    lo, hi = max(1, int(input_len * 0.9)), int(input_len * 1.1) + 1
    return [tok.decode(ids) for ids in make_prompts(tok, n, lo, hi, seed)]


def plot(summaries: list[RunSummary], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = [s for s in summaries if s.concurrency is not None]
    if not runs:
        return
    xs = [s.concurrency for s in runs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(xs, [s.output_tok_per_s for s in runs], marker="o")
    a.set(xlabel="concurrent clients", ylabel="output tokens/s", title="Throughput", xscale="log")
    b.plot(xs, [(s.ttft_p50_s or 0) * 1000 for s in runs], marker="o", label="TTFT p50")
    b.plot(xs, [(s.tpot_p50_s or 0) * 1000 for s in runs], marker="s", label="TPOT p50")
    b.plot(xs, [(s.e2e_p50_s or 0) * 1000 for s in runs], marker="^", label="end-to-end p50")
    b.set(xlabel="concurrent clients", ylabel="ms", title="Latency", xscale="log", yscale="log")
    for ax in (a, b):
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.grid(True, alpha=0.3)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    url = args.url.rstrip("/")
    runs = args.request_rate or args.concurrency
    counts = args.requests if len(args.requests) > 1 else args.requests * len(runs)
    if len(counts) != len(runs):
        raise ValueError(f"--requests has {len(counts)} values for {len(runs)} runs")
    summaries = []
    for i, (x, n) in enumerate(zip(runs, counts)):
        # Fresh prompts for every run, so a server's prefix cache cannot serve one run's
        # prompts from an earlier run.
        if args.workload == "repetitive":
            from sluice.bench.workload import make_repetitive_prompts
            prompts = make_repetitive_prompts(_tokenizer(args.tokenizer), n, args.seed + 1000 * i)
        else:
            prompts = make_text_prompts(args.tokenizer, n, args.input_len, args.seed + 1000 * i)
        if args.request_rate:
            s = asyncio.run(open_loop(url, args.model, prompts[:n], args.output_len, x, args.seed, args.api_key,
                                      args.new_connections, args.extra_body))
        else:
            s = asyncio.run(closed_loop(url, args.model, prompts[:n], args.output_len, x, args.api_key,
                                        args.new_connections, args.extra_body))
        summaries.append(s)
        print(json.dumps(asdict(s)), flush=True)
    report = {"url": url, "model": args.model, "input_len": args.input_len, "output_len": args.output_len,
              "runs": [asdict(s) for s in summaries]}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(summaries, args.plot)
    return 0 if all(s.failed == 0 for s in summaries) else 1


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="benchmark an OpenAI-compatible server with streaming clients")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="smollm2-135m", help="model name to send in requests")
    p.add_argument("--tokenizer", default="smollm2-135m", help="model whose tokenizer sizes the prompts")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32],
                   help="comma-separated closed-loop client counts (default 1,8,32)")
    p.add_argument("--request-rate", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="comma-separated Poisson arrival rates (req/s); replaces --concurrency")
    p.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=[64],
                   help="requests per run: one number, or one per concurrency / rate (e.g. 16,64,64)")
    p.add_argument("--workload", default="standard", choices=["standard", "repetitive"],
                   help="standard: windows of English text (--input-len); repetitive: chat prompts whose "
                        "answers repeat their context (edit this code, quote and summarise, an agent's tool "
                        "calls), for speculative decoding")
    p.add_argument("--input-len", type=int, default=210, help="prompt tokens (±10%%)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens (ignore_eos)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--new-connections", action="store_true",
                   help="open a new HTTP connection for every request: llama.cpp's llama-server answers a stream "
                        "with Keep-Alive and then closes the connection, and a request sent on it again fails")
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help='fields added to every request body, e.g. \'{"structured_outputs": {"json": {...}}}\'')
    p.add_argument("--json", default=None, help="write the report here")
    p.add_argument("--plot", default=None, help="write a PNG of throughput and latency vs concurrency")
    p.set_defaults(func=run)
