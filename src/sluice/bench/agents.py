"""`sluice bench agents`: seeded agent programs against any OpenAI-compatible server.

A program is a chain of calls. Call 1's prompt is the program's own system text and task;
every later call re-sends the whole history (each earlier prompt's new part, each reply)
plus a new tool result, after a tool gap drawn from a heavy-tailed distribution (log-
normal, median --tool-median s, capped at --tool-max s; with --tools K, each gap is one of
K named tools', whose medians spread from --tool-median / 8 to x 8). A share of the programs are
short (--short-calls calls), the rest long (--long-calls). Programs arrive as a Poisson
process (--program-rate per second) and belong to tenants in the shares given by
--tenant NAME=SHARE (a tenant is sent as the `user` field). With --sessions every call
carries its program's `session_id` (sluice's extension; other servers ignore it).

Reports, as JSON: job completion time (a program's first arrival to its last token)
p50/p99 per class, per-tenant TTFT and call latency p50/p99, output tokens/s over the
run, and the prefix-cache hit rate the server reported (usage.prompt_tokens_details).
"""
from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field

import aiohttp

from sluice.bench.serve import TIMEOUT, percentile, stream_completion
from sluice.config import parse_name_weights


@dataclass
class Program:
    program_id: str
    tenant: str
    kind: str                    # "short" or "long"
    start_delay: float           # seconds after the run starts
    first_prompt: str
    tool_results: list[str]      # one per call after the first
    tool_gaps: list[float]
    tool_names: list[str] = field(default_factory=list)  # with --tools: the tool of each gap


@dataclass
class CallResult:
    ok: bool
    ttft: float | None = None
    e2e: float = 0.0
    text: str = ""
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass
class ProgramResult:
    program: Program
    jct: float | None = None
    calls: list[CallResult] = field(default_factory=list)


def make_programs(args) -> list[Program]:
    from sluice.bench.serve import _tokenizer
    from sluice.bench.workload import make_prompts
    rng = random.Random(args.seed)
    tok = _tokenizer(args.tokenizer or args.model)
    shares = parse_tenants(args.tenant)
    names = list(shares)
    weights = [shares[n] for n in names]
    kinds = ["short" if rng.random() < args.short_frac else "long" for _ in range(args.programs)]
    calls = [rng.randint(*args.short_calls) if k == "short" else rng.randint(*args.long_calls) for k in kinds]
    texts = iter(tok.decode(ids) for ids in make_prompts(
        tok, args.programs * (1 + max(calls)), args.tool_len[0], args.tool_len[1], args.seed + 1))
    systems = iter(tok.decode(ids) for ids in make_prompts(tok, args.programs, args.system_len, args.system_len,
                                                           args.seed + 2))
    t, out = 0.0, []
    for i, (kind, n) in enumerate(zip(kinds, calls)):
        t += rng.expovariate(args.program_rate)
        tools = getattr(args, "tools", 0)
        if tools:
            # Tools of very different durations (a lookup, a search, a code run): medians
            # log-spaced from median / 8 to median x 8.
            picks = [rng.randrange(tools) for _ in range(n - 1)]
            medians = [args.tool_median * 8 ** (2 * k / max(1, tools - 1) - 1) for k in range(tools)]
            gaps = [min(args.tool_max, medians[k] * math.exp(rng.gauss(0.0, args.tool_sigma))) for k in picks]
        else:
            picks = []
            gaps = [min(args.tool_max, args.tool_median * math.exp(rng.gauss(0.0, args.tool_sigma)))
                    for _ in range(n - 1)]
        out.append(Program(f"prog-{args.seed}-{i}", rng.choices(names, weights)[0], kind, t,
                           f"{next(systems)}\n\nTask {i}: {next(texts)}\n",
                           [f"\nTool result: {next(texts)}\n" for _ in range(n - 1)], gaps,
                           [f"tool-{k}" for k in picks]))
    if args.only_tenant:
        out = [p for p in out if p.tenant == args.only_tenant]
    return out


def parse_tenants(items: list[str]) -> dict[str, float]:
    """--tenant NAME=SHARE flags (a bare NAME has share 1; none: one tenant)."""
    items = [i if "=" in i else f"{i}=1" for i in items or ["default"]]
    return parse_name_weights(items, "--tenant", "SHARE")


async def call(client: aiohttp.ClientSession, args, prompt: str, program: Program) -> CallResult:
    body = {"model": args.model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "user": program.tenant}
    if args.sessions:
        body["session_id"] = program.program_id
    r = await stream_completion(client, args.url, body, args.api_key)
    usage = r.usage or {}
    return CallResult(r.ok, r.ttft, r.e2e, r.text, usage.get("completion_tokens", 0), usage.get("prompt_tokens", 0),
                      (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), r.error)


async def run_program(client, args, program: Program, t_start: float) -> ProgramResult:
    await asyncio.sleep(max(0.0, t_start + program.start_delay - time.perf_counter()))
    begun = time.perf_counter()
    result = ProgramResult(program)
    history = program.first_prompt
    for i in range(len(program.tool_results) + 1):
        c = await call(client, args, history, program)
        result.calls.append(c)
        if not c.ok:
            return result
        history += c.text
        if i < len(program.tool_results):
            await asyncio.sleep(program.tool_gaps[i])  # the tool runs
            history += program.tool_results[i]
    result.jct = time.perf_counter() - begun
    return result


def summarize(results: list[ProgramResult], duration: float, args) -> dict:
    calls = [c for r in results for c in r.calls]
    ok = [c for c in calls if c.ok]
    out = {"programs": len(results), "failed_programs": sum(r.jct is None for r in results),
           "calls": len(calls), "failed_calls": len(calls) - len(ok), "duration_s": duration,
           "output_tok_per_s": sum(c.output_tokens for c in ok) / duration if duration else 0.0,
           "prefix_hit_rate": (sum(c.cached_tokens for c in ok) / max(1, sum(c.prompt_tokens for c in ok))),
           "sessions": args.sessions, "classes": {}, "tenants": {},
           "errors": sorted({c.error for c in calls if c.error})[:5]}
    jcts = [r.jct for r in results if r.jct is not None]
    out["jct_p50_s"], out["jct_p99_s"] = percentile(jcts, 0.5), percentile(jcts, 0.99)
    for kind in ("short", "long"):
        jcts = [r.jct for r in results if r.program.kind == kind and r.jct is not None]
        out["classes"][kind] = {"programs": len(jcts), "jct_p50_s": percentile(jcts, 0.5),
                                "jct_p99_s": percentile(jcts, 0.99)}
    for tenant in sorted({r.program.tenant for r in results}):
        tc = [c for r in results if r.program.tenant == tenant for c in r.calls if c.ok]
        ttfts = [c.ttft for c in tc if c.ttft is not None]
        jcts = [r.jct for r in results if r.program.tenant == tenant and r.jct is not None]
        out["tenants"][tenant] = {"programs": len(jcts), "calls": len(tc),
                                  "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
                                  "call_p50_s": percentile([c.e2e for c in tc], 0.5),
                                  "call_p99_s": percentile([c.e2e for c in tc], 0.99),
                                  "jct_p50_s": percentile(jcts, 0.5), "jct_p99_s": percentile(jcts, 0.99)}
    return out


async def run_all(args, programs: list[Program]) -> dict:
    # A new connection per call unless --keep-alive: a program's next call comes after its
    # tool gap, often past the server's idle timeout (uvicorn's is 5 s), and a pooled
    # connection the server has just closed resets the call sent on it.
    connector = aiohttp.TCPConnector(limit=1024, force_close=not args.keep_alive)
    async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run_program(client, args, p, t0) for p in programs))
        duration = time.perf_counter() - t0
    return summarize(list(results), duration, args)


def run(args) -> int:
    args.url = args.url.rstrip("/")
    programs = make_programs(args)
    if not programs:
        raise ValueError("no programs to run (--programs, --only-tenant)")
    report = asyncio.run(run_all(args, programs))
    report["config"] = {k: v for k, v in vars(args).items() if k not in ("func", "api_key")}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 1 if report["failed_calls"] else 0


def _pair(s: str) -> tuple[int, int]:
    lo, _, hi = s.partition(",")
    a, b = int(lo), int(hi or lo)
    if not 1 <= a <= b:
        raise ValueError(f"expected LO,HI with 1 <= LO <= HI, got {s!r}")
    return a, b


def add_parser(sub) -> None:
    p = sub.add_parser("agents", help="seeded multi-call agent programs against an OpenAI-compatible server")
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="smollm2-135m", help="model name sent, and the tokenizer for the texts")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the texts (default: --model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--programs", type=int, default=24)
    p.add_argument("--program-rate", type=float, default=0.5, help="programs arriving per second (Poisson)")
    p.add_argument("--short-frac", type=float, default=0.7, help="share of short programs (default 0.7)")
    p.add_argument("--short-calls", type=_pair, default=(2, 3), help="calls of a short program, LO,HI (2,3)")
    p.add_argument("--long-calls", type=_pair, default=(8, 12), help="calls of a long program, LO,HI (8,12)")
    p.add_argument("--system-len", type=int, default=300, help="tokens of a program's system text (300)")
    p.add_argument("--tool-len", type=_pair, default=(60, 120), help="tokens of a tool result, LO,HI (60,120)")
    p.add_argument("--output-len", type=int, default=32, help="tokens per reply (32)")
    p.add_argument("--tool-median", type=float, default=1.0, help="median tool gap, seconds (1.0)")
    p.add_argument("--tool-sigma", type=float, default=1.0, help="log-normal sigma of tool gaps (1.0)")
    p.add_argument("--tool-max", type=float, default=20.0, help="longest tool gap, seconds (20)")
    p.add_argument("--tools", type=int, default=0,
                   help="named tools of different medians (--tool-median / 8 to x 8) the gaps are drawn from "
                        "(default 0: one distribution)")
    p.add_argument("--tenant", action="append", default=[], metavar="NAME=SHARE",
                   help="a tenant and its share of the programs (repeatable; default one tenant)")
    p.add_argument("--only-tenant", default=None, help="run only this tenant's programs (its 'alone' baseline)")
    p.add_argument("--sessions", action="store_true", help="send each program's session_id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-alive", action="store_true",
                   help="reuse connections between calls (default: a new one per call; see run_all)")
    p.add_argument("--json", default=None, help="write the report here too")
    p.set_defaults(func=run)
