"""How cost grows: output tokens/s and TPOT against concurrency, TPOT against context
length, and the per-step time breakdown — offline, on the engine directly.

    python benchmarks/sweep.py [--json benchmarks/results/sweep.json] [--plot docs/img/sweep.png]

Concurrency c: c closed-loop clients (max_num_seqs=c), 2c requests of ~210-token prompts
and 64 output tokens, the default step budget. Context L: c requests whose prompts are L
tokens, 32 output tokens, all prompts in one step (so the rest are pure decode steps);
TPOT is the median time between a request's tokens after its first.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from sluice import LLMEngine, SamplingParams
from sluice.bench.workload import make_prompts


def closed_loop(engine: LLMEngine, prompts, concurrency: int, out_len: int) -> dict:
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    queue, tpots, tokens, rid = list(prompts), [], 0, 0
    last_token_time: dict[str, list[float]] = {}
    engine.timings.reset()
    t0 = time.perf_counter()
    for _ in range(min(concurrency, len(queue))):
        engine.add_request(f"s{rid}", queue.pop(0), params)
        rid += 1
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            last_token_time.setdefault(o.request_id, []).append(now)
            if o.finished:
                stamps = last_token_time.pop(o.request_id)
                gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                if gaps:
                    tpots.append(statistics.median(gaps))
                tokens += len(o.outputs[0].token_ids)
                if queue:
                    engine.add_request(f"s{rid}", queue.pop(0), params)
                    rid += 1
    secs = time.perf_counter() - t0
    return {"output_tok_per_s": tokens / secs, "tpot_p50_ms": 1e3 * statistics.median(tpots),
            "step_breakdown_ms": engine.timings.breakdown_ms()}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    conc = result["concurrency"]
    xs = [r["concurrency"] for r in conc]
    a = axes[0]
    a.plot(xs, [r["output_tok_per_s"] for r in conc], marker="o", color="tab:blue")
    a.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s", title="Throughput and TPOT vs concurrency")
    a.set_xticks(xs, [str(x) for x in xs])
    b = a.twinx()
    b.plot(xs, [r["tpot_p50_ms"] for r in conc], marker="s", color="tab:orange")
    b.set_ylabel("TPOT p50 (ms)", color="tab:orange")
    ctx = result["context"]
    for c in sorted({r["concurrency"] for r in ctx}):
        rows = [r for r in ctx if r["concurrency"] == c]
        axes[1].plot([r["context"] for r in rows], [r["tpot_p50_ms"] for r in rows], marker="o", label=f"c{c}")
    axes[1].set(xscale="log", xlabel="context length (tokens)", ylabel="TPOT p50 (ms)", title="TPOT vs context length")
    lengths = sorted({r["context"] for r in ctx})
    axes[1].set_xticks(lengths, [str(x) for x in lengths])
    axes[1].minorticks_off()
    axes[1].legend()
    phases = ["schedule", "prepare_inputs", "forward", "logits_and_sampling", "update_and_detokenize"]
    bars = [r for r in conc if r["concurrency"] in (1, 8, 32)]
    bottom = [0.0] * len(bars)
    for ph in phases:
        vals = [r["step_breakdown_ms"][ph] for r in bars]
        axes[2].bar([f"c{r['concurrency']}" for r in bars], vals, bottom=bottom, label=ph)
        bottom = [x + v for x, v in zip(bottom, vals)]
    axes[2].set(ylabel="ms per step", title="Step time breakdown")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", default="1,2,4,8,16,32,64")
    ap.add_argument("--contexts", default="256,512,1024,2048,4096")
    ap.add_argument("--context-concurrency", default="1,8")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args()
    result = {"concurrency": [], "context": []}
    for c in [int(x) for x in args.concurrency.split(",")]:
        engine = LLMEngine.from_kwargs(model=args.model, dtype=args.dtype, max_num_seqs=c,
                                       enable_prefix_caching=False)
        prompts = make_prompts(engine.tokenizer, 2 * c + 2, 190, 230, seed=c)
        closed_loop(engine, prompts[:2], min(c, 2), 4)  # warm-up
        row = {"concurrency": c, **closed_loop(engine, prompts[2:], c, 64)}
        result["concurrency"].append(row)
        print(json.dumps(row), flush=True)
    for c in [int(x) for x in args.context_concurrency.split(",")]:
        engine = LLMEngine.from_kwargs(model=args.model, dtype=args.dtype, max_num_seqs=c,
                                       enable_prefix_caching=False, kv_cache_memory=2.0)
        for length in [int(x) for x in args.contexts.split(",")]:
            # A budget that fits all c prompts in one step: every token after the first
            # then comes from a pure decode step at context ~length, which is what this
            # measures. Under the default budget the first requests would decode inside
            # the steps that carry the others' prompt chunks, and their TPOT would be the
            # time of a prompt step instead.
            engine.scheduler.config.max_num_batched_tokens = c * (length + 1)
            prompts = make_prompts(engine.tokenizer, c, length, length, seed=length + c)
            row = {"concurrency": c, "context": length, **closed_loop(engine, prompts, c, 32)}
            result["context"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
