"""What the data-parallel router's policy changes: 2 replicas, each policy, in one sitting.

    python benchmarks/routing.py --rounds 2 --json benchmarks/results/routing/routing.json

Per configuration and round it starts `sluice serve` (a fresh cache each time), drives two
workloads with closed-loop streaming clients, and reads the replicas' prefix-cache
counters and the router's decisions from /metrics:
- shared:    8 documents of ~450 tokens, 8 questions (~25 tokens) on each: 64 requests in
             a shuffled order, 8 clients;
- multiturn: 16 conversations of 4 turns, each turn re-sending the history (~300-token
             opening context, ~30-token turns) with the replies, 8 clients each running a
             conversation to its end; no session_id, so the policy alone decides.
Outputs are 16 (shared) and 24 (multiturn) tokens, greedy, ignore_eos. The replicas' KV
cache is small (--kv-cache-memory, default 0.06 GiB, ~2,800 tokens each): all 8 documents
(~3,600 tokens) do not fit one replica, half of them do.

Configurations: `single` (one server, no Ray, twice the cache: the reference) and
`dp2_<policy>` for round_robin, least_loaded and cache_aware. On a 2-core machine two
replicas share the same two cores (one thread each), so they add no throughput; what
routing changes is how much prompt work the caches save, so the hit rate and TTFT.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp

from sluice.bench.serve import TIMEOUT, _tokenizer, percentile, stream_completion
from sluice.bench.workload import make_prompts

ROOT = Path(__file__).resolve().parent.parent


def workloads(seed: int) -> dict:
    tok = _tokenizer("smollm2-135m")
    rng = random.Random(seed)
    docs = [tok.decode(ids) for ids in make_prompts(tok, 8, 430, 470, seed)]
    questions = [tok.decode(ids) for ids in make_prompts(tok, 64, 20, 30, seed + 1)]
    shared = [f"{docs[i // 8]}\n\nQuestion: {questions[i]}\nAnswer:" for i in range(64)]
    rng.shuffle(shared)
    openings = [tok.decode(ids) for ids in make_prompts(tok, 16, 280, 320, seed + 2)]
    turns = [tok.decode(ids) for ids in make_prompts(tok, 64, 25, 35, seed + 3)]
    multiturn = [[openings[c] + "\n\nUser: " + turns[4 * c]] + [f"\nUser: {turns[4 * c + t]}" for t in range(1, 4)]
                 for c in range(16)]
    return {"shared": shared, "multiturn": multiturn}


async def run_shared(url: str, prompts: list[str], clients: int, out_len: int) -> list:
    queue = list(prompts)
    results = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client:
        async def worker():
            while queue:
                body = {"model": "smollm2-135m", "prompt": queue.pop(0), "max_tokens": out_len, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                results.append(await stream_completion(client, url, body, None))
        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


async def run_multiturn(url: str, conversations: list[list[str]], clients: int, out_len: int) -> list:
    queue = list(conversations)
    results = []
    async with aiohttp.ClientSession(timeout=TIMEOUT) as client:
        async def worker():
            while queue:
                history = ""
                for turn in queue.pop(0):
                    history += turn + "\nAssistant:"
                    body = {"model": "smollm2-135m", "prompt": history, "max_tokens": out_len, "temperature": 0,
                            "ignore_eos": True, "stream": True}
                    r = await stream_completion(client, url, body, None)
                    results.append(r)
                    history += r.text
        await asyncio.gather(*(worker() for _ in range(clients)))
    return results


def scrape(url: str) -> dict:
    """Prefix-cache counters summed over replicas, and the router's decisions."""
    out = {"hits": 0.0, "queries": 0.0, "decisions": {}}
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("sluice_prefix_cache_hits_total"):
                out["hits"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sluice_prefix_cache_queries_total"):
                out["queries"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("sluice_router_requests_total{"):
                labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
                key = f"{labels['replica'].strip(chr(34))}/{labels['decision'].strip(chr(34))}"
                out["decisions"][key] = float(line.rsplit(" ", 1)[1])
    return out


def measure(url: str, name: str, work, clients: int, out_len: int) -> dict:
    before = scrape(url)
    t0 = time.perf_counter()
    runner = run_shared if name == "shared" else run_multiturn
    results = asyncio.run(runner(url, work, clients, out_len))
    secs = time.perf_counter() - t0
    after = scrape(url)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    queries = after["queries"] - before["queries"]
    decisions = {k: v - before["decisions"].get(k, 0) for k, v in after["decisions"].items()
                 if v != before["decisions"].get(k, 0)}
    return {"requests": len(results), "failed": len(results) - len(ok),
            "hit_rate": (after["hits"] - before["hits"]) / queries if queries else 0.0,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "output_tok_per_s": sum(r.chunks for r in ok) / secs, "seconds": secs, "decisions": decisions}


def start(flags: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "sluice.entrypoints.cli", "serve", "--port", str(port), *flags],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, HF_HUB_OFFLINE="1"), start_new_session=True)
    deadline = time.time() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server failed, see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        if time.time() > deadline:
            raise RuntimeError("server did not come up")
        time.sleep(1)


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--kv-cache-memory", type=float, default=0.06, help="GiB per replica")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--port", type=int, default=8131)
    ap.add_argument("--only", default=None, help="a substring of the configurations to run")
    ap.add_argument("--json", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    kv = str(args.kv_cache_memory)
    configs = {"single": ["--kv-cache-memory", str(2 * args.kv_cache_memory)]}
    for policy in ("round_robin", "least_loaded", "cache_aware"):
        configs[f"dp2_{policy}"] = ["--data-parallel-size", "2", "--router-policy", policy, "--kv-cache-memory", kv]
    configs = {k: v for k, v in configs.items() if args.only is None or args.only in k}
    loads = workloads(args.seed)
    out_dir = Path(args.json).parent if args.json else Path("/tmp")
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: dict = {name: {"shared": [], "multiturn": []} for name in configs}
    for rnd in range(args.rounds):
        for name, flags in configs.items():
            proc = start(flags, args.port, out_dir / f"{name}_r{rnd}.log")
            url = f"http://127.0.0.1:{args.port}"
            try:
                # Warm-up: one short request per replica's kernels and caches, then a clean cache.
                asyncio.run(run_shared(url, ["warm up " * 8] * 4, 2, 2))
                urllib.request.urlopen(urllib.request.Request(f"{url}/reset_prefix_cache", method="POST"),
                                       timeout=30).read()
                for wl, out_len in (("shared", 16), ("multiturn", 24)):
                    row = measure(url, wl, loads[wl], args.clients, out_len)
                    runs[name][wl].append(row)
                    print(json.dumps({"config": name, "round": rnd, "workload": wl, **row}), flush=True)
            finally:
                stop(proc)
    table = []
    for name in configs:
        for wl in ("shared", "multiturn"):
            rows = runs[name][wl]
            med = {k: statistics.median(r[k] for r in rows) for k in ("hit_rate", "ttft_p50_s", "ttft_p99_s",
                                                                     "output_tok_per_s")}
            table.append({"config": name, "workload": wl, "rounds": len(rows), **med,
                          "failed": sum(r["failed"] for r in rows), "decisions_last_round": rows[-1]["decisions"]})
    print("| config | workload | hit rate | TTFT p50 (s) | TTFT p99 (s) | output tok/s | failed |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['config']} | {t['workload']} | {t['hit_rate']:.1%} | {t['ttft_p50_s']:.2f} | "
              f"{t['ttft_p99_s']:.2f} | {t['output_tok_per_s']:.1f} | {t['failed']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": table, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
