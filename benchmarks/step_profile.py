"""Where a step's milliseconds go, offline and served, against the floor each part is
judged by.

    python benchmarks/step_profile.py [--model smollm2-135m] [--quantization auto] [--kv-cache-dtype auto]
        [--cpu-isa auto] [--batches 1,8,32,128] [--served 1,32] [--workload] [--json F]

Offline, one engine (speculation off, so every step is a plain decode): for each batch of
B requests (64-token prompts), once their prompts are in, the median over 40 decode steps
of each phase of LLMEngine.step (its StepTimings, one step at a time) and of the step's wall time: schedule, input preparation, the forward
pass, logits and sampling (LM head, sampler, the host sync), update and detokenization;
and one mixed kind of step, B decodes beside a 128-token prompt chunk (bound by arithmetic,
so given no memory floor). Beside the decode steps the
floor of the step: the bytes it must read (every linear layer's packed weights and the LM
head's, once, and each request's K/V) at the memory bandwidth measured here (torch reading
a 1 GiB buffer, best of 5), so `forward + logits / floor` says how far the kernels are
from the memory. The 40 decode steps run in four blocks with a reading before each block
and after the last; a block is judged by the better of the two readings around it, and
the row gives the median block's ratio (a shared VM's reading moves by a third within
minutes, and its steps with it).

Served (`--served`): the same engine settings behind `sluice serve`, the c1 and c32 loads
of `sluice bench serve` (64-token prompts, 64 outputs); the inter-token latency p50 against
the offline step time at that batch size is what the server costs per token (HTTP, SSE,
the event loop, the GIL shared with the engine thread).

By kind: where the one-call decoder stack runs the layers (a Llama-shaped model on the CPU
kernels), the same decode and mixed steps with the stack's own clock on (DecoderStack.set_profile:
the calling thread's wall time per kind of kernel call, so a linear call includes waiting
for the other threads' shares); "other" is the forward's rest (embedding, RoPE tables, the
first norm, the call into the stack). Elsewhere, the model's Python loop over its layers
instead (the same kernels, one call each), each Linear (by role) and each op timed: that
loop's own cost inflates the forward, so those rows say where the time goes, not what a
step takes (decode steps only).

`--workload`: the side-by-side tables' c32 workload run offline (64 windows of English text
of ~210 tokens, sluice.bench.workload's, and 128 output tokens, 32 at a time, greedy) with the stack's clock on: the whole run's
seconds by phase and by kind of kernel call, prompt steps included.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path


import torch

ROOT = Path(__file__).resolve().parents[1]


# The 40 decode steps of a row in this many blocks, the memory read around each (offline).
DECODE_BLOCKS = 4


def bandwidth_gbps() -> float:
    buf = torch.ones(2**28, dtype=torch.float32)  # 1 GiB
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        buf.sum()
        best = max(best, buf.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def weight_bytes(model) -> int:
    """Bytes a greedy decode step reads of the weights: what each linear layer's method
    multiplies by at a few rows (KernelWeight's choice: 4-bit nibbles with their float16
    scales where they have their own, int8 x int8, int8
    weights, else the packed bf16 weight), and the head's (the greedy head's int8 copy where there is
    one); norms and the embedding rows it gathers are negligible."""
    def read(method) -> list:
        if isinstance(method, torch.Tensor):
            return [method]
        for fields in (("w4nib", "w4nib_scales"), ("w4nib", "w4d", "w4m"), ("w4a8", "w4d", "w4m"), ("w8a8", "qscale"),
                       ("q_packed", "qscale"),
                       ("packed",),
                       ("weight",)):
            if all(getattr(method, f, None) is not None for f in fields):
                return [getattr(method, f) for f in fields]
        return []
    tensors = [t for m in model.modules() if getattr(m, "method", None) is not None for t in read(m.method)]
    greedy = getattr(model, "greedy_head", None)
    tensors += [greedy.packed_int8, greedy.scale] if greedy is not None else read(getattr(model, "head", None))
    seen, total = set(), 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


def kv_bytes_per_token(engine) -> float:
    caches = engine.runner.kv_caches
    total = sum(t.numel() * t.element_size() for pair in caches for t in pair)
    return total / ((engine.runner.num_blocks + 1) * engine.runner.block_size)


def offline(args) -> tuple[list[dict], dict]:
    from sluice import LLMEngine, SamplingParams
    engine = LLMEngine.from_kwargs(model=args.model, speculative_method=None, quantization=args.quantization,
                                   kv_cache_dtype=args.kv_cache_dtype, max_num_seqs=max(args.batches) + 1,
                                   kv_cache_memory=1.0, cpu_isa=args.cpu_isa)
    model = engine.runner.model
    wb, kvb = weight_bytes(model), kv_bytes_per_token(engine)
    info = {"plan": engine.backend.line(), "weight_mb": wb / 1e6, "kv_bytes_per_token": kvb}
    rng = random.Random(0)
    rows = []
    for b in args.batches:
        for mixed in (False, True):
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            for i in range(b):
                engine.add_request(f"b{b}-{mixed}-{i}", [rng.randrange(3, 40000) for _ in range(64)], params)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
                    or engine.scheduler.waiting:
                engine.step()
            engine.step()
            # Decode steps in blocks, the memory read before each block and after the last
            # (a step's floor is reading, and this shared VM's reading moved from 16 to 26
            # GB/s within minutes, the steps with it): each block is judged by the better of
            # the two readings around it, and the row by the median block. A step with a
            # prompt chunk is bound by arithmetic (its own floor is the kernels' table in
            # docs/benchmarks.md).
            blocks = 1 if mixed else DECODE_BLOCKS
            steps = 40 if not mixed else 8
            per_step, walls, ratios, floors = [], [], [], []
            before = None if mixed else bandwidth_gbps()
            readings = [] if mixed else [before]
            for blk in range(blocks):
                ctx = sum(r.num_tokens for r in engine.scheduler.running)
                n = steps // blocks
                block = []
                for s in range(n):
                    if mixed:  # a 128-token prompt chunk beside the decodes, every step
                        engine.add_request(f"m{b}-{s}", [rng.randrange(3, 40000) for _ in range(128)],
                                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                    engine.timings.reset()
                    t0 = time.perf_counter()
                    engine.step()
                    walls.append((time.perf_counter() - t0) * 1e3)
                    block.append(engine.timings.breakdown_ms())
                per_step += block
                if not mixed:
                    after = bandwidth_gbps()
                    readings.append(after)
                    floor = (wb + kvb * (ctx + b * n / 2)) / (max(before, after) * 1e9) * 1e3
                    floors.append(floor)
                    ratios.append(statistics.median(d["forward"] + d["logits_and_sampling"] for d in block) / floor)
                    before = after
            # Medians over the steps, each phase's own: on a shared VM a few slow steps
            # (another tenant, a page fault) moved a mean of 40 by a third between runs.
            wall = statistics.median(walls)
            ms = {k: statistics.median(d[k] for d in per_step) for k in per_step[0]}
            rows.append({"batch": b, "mixed": mixed, **{k: round(v, 3) for k, v in ms.items()},
                         "wall_ms": round(wall, 3),
                         "floor_ms": round(statistics.median(floors), 3) if floors else None,
                         "vs_floor": round(statistics.median(ratios), 2) if ratios else None,
                         "gbps_readings": [round(g, 1) for g in readings] or None})
            print(json.dumps(rows[-1]), flush=True)
            for r in list(engine.scheduler.running) + list(engine.scheduler.waiting):
                engine.abort(r.request_id)
            while engine.has_unfinished_requests():
                engine.step()
    info["kinds"] = layer_kinds(engine, args.batches, rng)
    if args.workload:
        info["workload"] = workload_kinds(engine)
    return rows, info


def concurrencies(text: str) -> list[int]:
    """'1,32' -> [1, 32]; each at least 1."""
    values = [int(x) for x in text.split(",") if x]
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"concurrencies must be at least 1, got {text!r}")
    return values


class _TimedOps:
    """The backend's ops with each call's wall time added to `spent` by op name."""

    def __init__(self, ops, spent: dict):
        self._ops, self._spent = ops, spent

    def __getattr__(self, name):
        fn = getattr(self._ops, name)

        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self._spent[name] = self._spent.get(name, 0.0) + time.perf_counter() - t0
            return out
        return timed


def _decode_steps(engine, b: int, rng, steps: int, measure, mixed: bool = False) -> dict:
    """b requests (64-token prompts) brought to decoding, then `steps` decode steps run
    inside measure(run) (mixed: each beside a new request's 128-token prompt, whole in the
    step); returns the engine's mean ms per phase over them."""
    from sluice import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=60 + (steps if mixed else 0), ignore_eos=True)
    for i in range(b):
        engine.add_request(f"k{b}-{mixed}-{i}", [rng.randrange(3, 40000) for _ in range(64)], params)
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()
    engine.step()
    engine.timings.reset()

    def run():
        for s in range(steps):
            if mixed:
                engine.add_request(f"p{b}-{s}", [rng.randrange(3, 40000) for _ in range(128)],
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            engine.step()
    measure(run)
    ms = engine.timings.breakdown_ms()
    for r in list(engine.scheduler.running):
        engine.abort(r.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return ms


def layer_kinds(engine, batches: list[int], rng) -> list[dict]:
    """The forward by kind of work, per decode step: from the decoder stack's own clock
    where it runs the layers, else from the model's Python loop."""
    stack = getattr(engine.runner.model.fast_forward, "stack", None)
    if stack is not None and hasattr(stack, "set_profile"):
        return stack_kinds(engine, stack, batches, rng)
    return loop_kinds(engine, batches, rng)


def stack_kinds(engine, stack, batches: list[int], rng) -> list[dict]:
    """Each kind of kernel call of the decoder stack, timed by the stack itself (the
    forward as the engine runs it, its other parts as "other")."""
    rows = []
    for b in batches:
        for mixed in (False, True):
            steps = 8 if mixed else 40

            def measure(run):
                stack.reset_profile()
                stack.set_profile(True)
                try:
                    run()
                finally:
                    stack.set_profile(False)
            ms = _decode_steps(engine, b, rng, steps, measure, mixed)
            names, seconds, calls = stack.profile()
            if calls != steps:  # a step the stack did not take (its Python loop ran instead)
                raise RuntimeError(f"the decoder stack ran {calls} of {steps} steps at batch {b}")
            row = {"batch": b, "mixed": mixed, "source": "decoder stack", "forward": round(ms["forward"], 3)}
            for name, sec in sorted(zip(names, seconds), key=lambda kv: -kv[1]):
                row[name] = round(1e3 * sec / steps, 3)
            row["other"] = round(ms["forward"] - 1e3 * sum(seconds) / steps, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def workload_kinds(engine, requests: int = 64, concurrency: int = 32, output: int = 128) -> dict | None:
    """A whole closed-loop workload offline, the standard one of the side-by-side tables
    (64 windows of English text of 189-232 tokens, as `sluice bench serve` sends, and 128
    output tokens, 32 at a time): the seconds of each phase over the run and, where the
    decoder stack runs the layers, of each kind of kernel call; where a c32 run's time
    goes, prompt steps included."""
    from sluice import SamplingParams
    from sluice.bench.workload import make_prompts
    stack = getattr(engine.runner.model.fast_forward, "stack", None)
    if stack is None or not hasattr(stack, "set_profile"):
        return None
    prompts = make_prompts(engine.tokenizer, requests, 189, 232)  # as bench serve sizes --input-len 210
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    engine.timings.reset()
    stack.reset_profile()
    stack.set_profile(True)
    sent, steps, t0 = 0, 0, time.perf_counter()
    try:
        while sent < requests or engine.has_unfinished_requests():
            while sent < requests and len(engine.scheduler.running) + len(engine.scheduler.waiting) < concurrency:
                engine.add_request(f"w{sent}", prompts[sent], params)
                sent += 1
            engine.step()
            steps += 1
    finally:
        stack.set_profile(False)
    wall = time.perf_counter() - t0
    ms = engine.timings.breakdown_ms()
    names, seconds, calls = stack.profile()
    out = {"requests": requests, "concurrency": concurrency, "prompt": sum(map(len, prompts)) // requests,
           "output": output,
           "wall_s": round(wall, 3), "steps": steps, "stack_steps": calls,
           "output_tok_per_s": round(requests * output / wall, 1),
           "phases_s": {k: round(v * steps / 1e3, 3) for k, v in ms.items() if k != "total"},
           "kinds_s": {n: round(sec, 3) for n, sec in sorted(zip(names, seconds), key=lambda kv: -kv[1])}}
    print(json.dumps(out), flush=True)
    return out


def loop_kinds(engine, batches: list[int], rng) -> list[dict]:
    """The same decode steps with the model's own Python loop over its layers run instead
    of the one-call decoder stack (the same kernels, one call each), each Linear's method
    and each op timed apart. Linears by role (qkv, o, gate_up, down, head), then attention
    (the paged kernel), rope + K/V write, the residual adds with RMSNorm, SwiGLU; "other"
    is the forward's rest (embedding, RoPE tables, the loop)."""
    model = engine.runner.model
    spent: dict[str, float] = {}
    saved_ff, saved_ops, saved_methods = model.fast_forward, {}, {}
    try:
        model.fast_forward = None
        for name, m in model.named_modules():
            if hasattr(type(m), "ops") and not isinstance(m.ops, _TimedOps):
                saved_ops[name] = m.ops
                m.ops = _TimedOps(m.ops, spent)
            method = getattr(m, "method", None)
            if method is not None:
                role = name.rsplit(".", 1)[-1].removesuffix("_proj")

                def timed(*a, _f=method, _r=role, **k):
                    t0 = time.perf_counter()
                    out = _f(*a, **k)
                    spent[_r] = spent.get(_r, 0.0) + time.perf_counter() - t0
                    return out
                saved_methods[name] = method
                m.method = timed
        rows, steps = [], 20
        for b in batches:
            def measure(run):
                spent.clear()
                run()
            ms = _decode_steps(engine, b, rng, steps, measure)
            row = {"batch": b, "source": "Python layer loop", "forward": round(ms["forward"], 3)}
            for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
                row[k] = round(1e3 * v / steps, 3)
            timed_forward = sum(v for k, v in spent.items() if k != "head") * 1e3 / steps
            row["other"] = round(ms["forward"] - timed_forward, 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
        return rows
    finally:
        model.fast_forward = saved_ff
        for name, m in model.named_modules():
            if name in saved_ops:
                m.ops = saved_ops[name]
            if name in saved_methods:
                m.method = saved_methods[name]


def served(args, offline_rows: list[dict]) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--port", str(port), "--model", args.model, "--speculative-method", "off", "--kv-cache-dtype", args.kv_cache_dtype,
             "--quantization", "none" if args.quantization is None else args.quantization, "--cpu-isa", args.cpu_isa]
    log = open(args.out_dir / f"{args.prefix}_server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "sluice.entrypoints.cli", "serve", *flags], stdout=log,
                              stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    rows = []
    try:
        import httpx
        while True:
            assert server.poll() is None, f"the server died ({args.prefix}_server.log)"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        for c in args.served:
            report = args.out_dir / f"{args.prefix}_c{c}.json"
            subprocess.run([sys.executable, "-m", "sluice.entrypoints.cli", "bench", "serve", "--url",
                            f"http://127.0.0.1:{port}", "--model", args.model, "--tokenizer", args.model, "--concurrency", str(c), "--requests", str(max(8, 2 * c)),
                            "--input-len", "64", "--output-len", "64", "--json", str(report)],
                           check=True, capture_output=True)
            r = json.loads(report.read_text())["runs"][0]
            step = next((o["wall_ms"] for o in offline_rows if o["batch"] == c and not o["mixed"]), None)
            itl = 1e3 * (r["itl_p50_s"] or 0)
            rows.append({"concurrency": c, "itl_p50_ms": round(itl, 3), "tpot_p50_ms": round(1e3 * r["tpot_p50_s"], 3),
                         "offline_step_ms": step, "server_ms_per_token": None if step is None else round(itl - step, 3)})
            print(json.dumps(rows[-1]), flush=True)
    finally:
        server.terminate()
        server.wait(60)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="auto", help="auto (the default), none, int8, w8a8, w4a8, gguf")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cpu-isa", default="auto", help="kernel build: auto (the CPU's best), avx512, avx512_vnni, avx2_vnni, avx2")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128])
    ap.add_argument("--served", type=concurrencies, default=[1, 32],
                    help="concurrencies to serve at, comma-separated ('' for none)")
    ap.add_argument("--workload", action="store_true",
                    help="also the c32 workload of the side-by-side tables offline, its time by phase and kind")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.quantization = None if args.quantization == "none" else args.quantization
    # The served run's client reports and server log go beside --json, named after it (a
    # fixed name there overwrote another run's files in a shared results folder).
    args.out_dir = (args.json.parent if args.json else ROOT / "benchmarks" / "results")
    args.prefix = args.json.stem if args.json else "step_profile"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows, info = offline(args)
    serve_rows = served(args, rows) if args.served else []
    readings = [g for r in rows for g in r["gbps_readings"] or []]
    info["gbps_readings"] = [min(readings), statistics.median(readings), max(readings)] if readings else None
    print(f"\n{info['plan']}\nweights read per step {info['weight_mb']:.1f} MB, K+V {info['kv_bytes_per_token']:.0f} "
          f"B/token, memory read at " + ("?" if not readings else
          f"{min(readings):.1f}-{max(readings):.1f} GB/s (median {statistics.median(readings):.1f}) around the "
          f"blocks of {40 // DECODE_BLOCKS} decode steps") + "\n")
    print("| batch | step | schedule | prepare | forward | logits + sampling | update + detok | total | floor | "
          "(forward + logits) / floor |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {'mixed' if r['mixed'] else 'decode'} | {r['schedule']:.2f} | "
              f"{r['prepare_inputs']:.2f} | {r['forward']:.2f} | {r['logits_and_sampling']:.2f} | "
              f"{r['update_and_detokenize']:.2f} | {r['total']:.2f} | "
              + ("– | – |" if r["floor_ms"] is None else f"{r['floor_ms']:.2f} | {r['vs_floor']:.2f}x |"))
    kinds = info["kinds"]
    names = [k for k in kinds[0] if k not in ("batch", "source", "forward")]
    print(f"\nThe forward by kind ({kinds[0]['source']}, ms per step; the head is outside the forward):\n")
    names = [k for k in names if k != "mixed"]
    print("| batch | step | forward | " + " | ".join(names) + " |\n|" + "---|" * (len(names) + 3))
    for r in kinds:
        print(f"| {r['batch']} | {'mixed' if r.get('mixed') else 'decode'} | {r['forward']:.2f} | "
              + " | ".join(f"{r.get(n, 0):.2f}" for n in names) + " |")
    w = info.get("workload")
    if w:
        print(f"\nThe c32 workload offline ({w['requests']} x {w['prompt']}/{w['output']} tokens at c{w['concurrency']}): "
              f"{w['wall_s']:.2f} s, {w['output_tok_per_s']:.0f} tok/s, {w['steps']} steps\n")
        print("| part | s | share |\n|---|---|---|")
        parts = {**{f"forward: {k}": v for k, v in w["kinds_s"].items()},
                 "forward: other": w["phases_s"]["forward"] - sum(w["kinds_s"].values()),
                 **{k: v for k, v in w["phases_s"].items() if k != "forward"}}
        for k, v in parts.items():
            print(f"| {k} | {v:.2f} | {100 * v / w['wall_s']:.0f}% |")
    if serve_rows:
        print("\n| concurrency | served ITL p50 | offline step | the server's ms per token |\n|---|---|---|---|")
        def ms(v) -> str:  # no offline step at a concurrency --batches left out
            return "–" if v is None else f"{v:.2f}"
        for r in serve_rows:
            print(f"| {r['concurrency']} | {ms(r['itl_p50_ms'])} | {ms(r['offline_step_ms'])} | "
                  f"{ms(r['server_ms_per_token'])} |")
    if args.json:
        args.json.write_text(json.dumps({"info": info, "offline": rows, "served": serve_rows,
                                         "date": time.strftime("%Y-%m-%d")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
