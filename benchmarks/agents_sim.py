"""Replay `sluice bench agents`' seeded load through the real Scheduler in simulated time.

A policy experiment on the served agent load takes 10-30 minutes a run on a noisy 2-core
box. This replays the same programs (make_programs: same seed and flags) through the
engine's own Scheduler, KVCacheManager and SessionTable, with the forward pass replaced
by a step-time model fitted on this machine (`fit`: t = a + b tokens + c attention pairs
+ d sampled rows, least squares over the engine's real steps), on a clock that advances
by each step's modelled time. A run takes seconds and repeats exactly, so scheduling
ideas can be ranked, over several seeds, before they are measured for real.

    # once per machine (~3 minutes): time the engine's steps and fit the model
    .venv/bin/python benchmarks/agents_sim.py fit --out /tmp/step_model.json
    # the load of docs/benchmarks.md's "Agent programs" table
    .venv/bin/python benchmarks/agents_sim.py run --model-json /tmp/step_model.json \
        --programs 96 --program-rate 0.5 --kv-gib 0.25 --policy fcfs
    .venv/bin/python benchmarks/agents_sim.py run ... --policy program --sessions [--variant nodoor]

--offload-gib G adds the host KV tier (core/kv_offload.py) under the cache: evicted blocks
are saved there and reloaded on a hit, each copy adding its measured cost to the step
(--offload-save-us / --offload-load-us per block, from benchmarks/kv_offload_copy.py; the
defaults are its int8 figures on the Xeon box of docs/benchmarks.md).

--slowdown scales the modelled step times to match what the served runs show (the
server's HTTP, streaming and the load generator share the cores; 1.1-1.25 on the box of
lab-notes.md's "Sessions and agent programs"). Not modelled: tokenization (a call
re-sends its history as token ids, so every re-sent block matches), speculative
decoding. What it is for: ranking orders; the served figures are the ones
docs/benchmarks.md reports.
"""
from __future__ import annotations

import argparse
import heapq
import json
import random
import sys
import time

from sluice.bench.serve import percentile
from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.kv_offload import OffloadIndex
from sluice.core.scheduler import SampledToken, Scheduler, StepResult
from sluice.request import Request, RequestStatus
from sluice.sampling_params import SamplingParams

BLOCK_SIZE = 16
# SmolLM2-135M's KV bytes per token in bf16: 30 layers x (K, V) x 3 heads x 64 x 2 bytes.
KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2
# One offloaded block of it: exact (bf16), or int8 rows with a float32 scale each.
OFFLOAD_BLOCK_BYTES = {"exact": KV_BYTES_PER_TOKEN * BLOCK_SIZE, "int8": 30 * 2 * 3 * (64 + 4) * BLOCK_SIZE}


def features(plan) -> tuple[float, float, float, float]:
    """(1, tokens, attention work in 1k token-pairs, rows sampled) of a step."""
    tokens = attn = rows = 0
    for e in plan.scheduled:
        n = len(e.token_ids)
        tokens += n
        attn += n * (e.start_pos + (n + 1) / 2) / 1e3
        rows += e.needs_logits
    return 1.0, float(tokens), attn, float(rows)


# -- fit: time the engine's real steps ---------------------------------------------------
def fit(args) -> int:
    import torch

    from sluice.engine.llm_engine import LLMEngine
    engine = LLMEngine.from_kwargs(kv_cache_memory=args.kv_gib, speculative_method=None)
    runner = engine.runner
    samples: list[tuple[tuple[float, ...], float]] = []
    real = runner.execute

    def timed(plan):
        t0 = time.perf_counter()
        out = real(plan)
        samples.append((features(plan), time.perf_counter() - t0))
        return out
    runner.execute = timed
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    # Crowds of agent-like calls: histories of 100-2000 tokens, 32-token replies.
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    for crowd in (1, 2, 4, 8, 16, 24, 32):
        for i in range(crowd):
            prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(100, 2000))]
            engine.add_request(f"crowd{crowd}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    samples = samples[5:]  # the first steps warm up (allocations, thread pools)
    x = torch.tensor([s[0] for s in samples], dtype=torch.float64)
    y = torch.tensor([s[1] for s in samples], dtype=torch.float64)
    coef = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).clamp(min=0.0)
    pred = x @ coef
    err = ((pred - y).abs() / y).median().item()
    model = {"coef": coef.tolist(), "names": ["const_s", "per_token_s", "per_kpair_s", "per_row_s"],
             "steps": len(samples), "median_rel_err": err}
    print(json.dumps(model, indent=2))
    with open(args.out, "w") as f:
        json.dump(model, f)
    return 0


# -- run: the load through the scheduler -------------------------------------------------
class Sim:
    def __init__(self, args, coef: list[float]):
        self.coef = coef
        self.now = 0.0
        num_blocks = int(args.kv_gib * 2**30 / (KV_BYTES_PER_TOKEN * BLOCK_SIZE))
        offload = None
        if args.offload_gib > 0:
            offload = OffloadIndex(int(args.offload_gib * 2**30 / OFFLOAD_BLOCK_BYTES[args.offload_dtype]),
                                   block_size=BLOCK_SIZE)
        self.kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching=True, offload=offload)
        cfg = SchedulerConfig(max_num_batched_tokens=args.max_num_batched_tokens, policy=args.policy,
                              starvation_s=args.starvation_s, max_pinned_fraction=args.max_pinned_fraction)
        cls = VARIANTS.get(args.variant, Scheduler)
        self.sched = cls(cfg, self.kv, 8192, clock=lambda: self.now)
        self.args = args
        self.params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def run(self, programs: list[dict]) -> dict:
        events: list[tuple[float, int, int]] = []  # (time, seq, program index): a call is sent
        for i, p in enumerate(programs):
            heapq.heappush(events, (p["start"], i, i))
            p["history"] = list(p["first"])
            p["call"] = 0
            p["calls"] = []
        seq = len(programs)
        inflight: dict[str, int] = {}
        steps = preempt = 0
        busy = 0.0
        while events or self.sched.has_unfinished_requests():
            if not self.sched.has_unfinished_requests() and events and events[0][0] > self.now:
                self.now = events[0][0]
            while events and events[0][0] <= self.now:
                _, _, i = heapq.heappop(events)
                p = programs[i]
                rid = f"{p['id']}-{p['call']}"
                req = Request(rid, p["history"], self.params, set(), self.args.output_len,
                              session_id=p["id"] if self.args.sessions else None, tenant="t",
                              arrival_time=self.now)
                self.sched.add_request(req)
                inflight[rid] = i
                p["sent"] = self.now
            plan = self.sched.schedule()
            if plan.is_empty:
                if not events:
                    raise RuntimeError("nothing schedulable and nothing to come: the scheduler is stuck")
                self.now = max(self.now, events[0][0])
                continue
            preempt += len(plan.preempted)
            dt = self.args.slowdown * sum(c * f for c, f in zip(self.coef, features(plan)))
            saves = sum(t[0] == "save" for t in plan.kv_transfers)
            dt += 1e-6 * (saves * self.args.offload_save_us
                          + (len(plan.kv_transfers) - saves) * self.args.offload_load_us)
            self.now += dt
            busy += dt
            steps += 1
            result = StepResult({e.request_id: SampledToken(1000 + (steps * 7 + k) % 30000)
                                 for k, e in enumerate(plan.scheduled) if e.needs_logits})
            update = self.sched.update(plan, result)
            for req in update.finished:
                i = inflight.pop(req.request_id)
                p = programs[i]
                p["calls"].append({"latency": self.now - p["sent"], "cached": req.num_cached_tokens,
                                   "prompt": req.num_prompt_tokens})
                p["history"] = list(req.prompt_token_ids) + list(req.output_token_ids)
                p["call"] += 1
                if p["call"] < len(p["tools"]) + 1:
                    if self.args.tool_hints and p["tool_names"]:
                        # What the server does when a chat call ends in tool calls.
                        self.sched.session_tool_called("t", p["id"], [p["tool_names"][p["call"] - 1]])
                    p["history"] += p["tools"][p["call"] - 1]
                    seq += 1
                    heapq.heappush(events, (self.now + p["gaps"][p["call"] - 1], seq, i))
                else:
                    p["jct"] = self.now - p["start"]
        return self.report(programs, steps, preempt, busy)

    def report(self, programs, steps, preempt, busy) -> dict:
        """The figures `sluice bench agents` reports, in simulated seconds."""
        def p(kind: str | None, q: float) -> float | None:
            xs = [x["jct"] for x in programs if kind is None or x["kind"] == kind]
            return round(percentile(xs, q), 1) if xs else None
        calls = [c for x in programs for c in x["calls"]]
        return {"jct_p50_s": p(None, 0.5), "jct_p99_s": p(None, 0.99), "short_p50_s": p("short", 0.5),
                "long_p50_s": p("long", 0.5),
                "output_tok_per_s": round(len(calls) * self.args.output_len / self.now, 1),
                "busy": round(busy / self.now, 2),
                "prefix_hit_rate": round(sum(c["cached"] for c in calls) / sum(c["prompt"] for c in calls), 2),
                "steps": steps, "preemptions": preempt, "makespan_s": round(self.now, 1),
                "offload_hits": self.kv.offload.host.stats.hits if self.kv.offload is not None else 0,
                "sessions": dict(vars(self.sched.sessions.stats))}


class NoDoorScheduler(Scheduler):
    """The `program` policy without its door (as it was before the door was added)."""

    def _door_open(self, now):
        return lambda r: True


class AdaptiveDoorScheduler(Scheduler):
    """`program`'s door shut only while pins are being lost (pushed out for the cap or for
    room within the last DOOR_MEMORY_S seconds); open otherwise."""
    DOOR_MEMORY_S = 30.0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._losses = 0
        self._last_loss = float("-inf")

    def _door_open(self, now):
        st = self.sessions.stats
        losses = st.evicted_for_cap + st.evicted_for_room
        if losses != self._losses:
            self._losses, self._last_loss = losses, now
        if now - self._last_loss > self.DOOR_MEMORY_S:
            return lambda r: True
        return super()._door_open(now)


class PinDoorScheduler(Scheduler):
    """`program`'s door as it is without a tier (pins counted, the whole pin budget) even
    with one: what the door was before it counted only running calls under a tier."""

    def _door_open(self, now):
        offload, self.kv.offload = self.kv.offload, None
        try:
            return super()._door_open(now)
        finally:
            self.kv.offload = offload


class ArrivalOrderScheduler(Scheduler):
    """`program` with its door and warm calls first, but the calls in arrival order instead
    of PLAS's least service first (the tail's programs are the most served). With a KV
    tier this is what the engine's scheduler does (Scheduler._program_key); without one,
    the variant to compare."""

    def _program_key(self, r, now):
        starved_or_not, cold, _service, arrival = super()._program_key(r, now)
        return (starved_or_not, cold, 0, arrival)  # the tier's key: PLAS's service dropped


# --variant: a scheduler changed in one place, to compare against the engine's own.
VARIANTS = {"nodoor": NoDoorScheduler, "adaptive": AdaptiveDoorScheduler, "pindoor": PinDoorScheduler,
            "arrival": ArrivalOrderScheduler}


def load(args) -> list[dict]:
    """The programs of `sluice bench agents` with these flags, as token ids."""
    from sluice.bench.agents import make_programs
    from sluice.bench.serve import _tokenizer
    ns = argparse.Namespace(seed=args.seed, tokenizer=None, model=args.tokenizer, tenant=[], programs=args.programs,
                            short_frac=args.short_frac, short_calls=(2, 3), long_calls=(8, 12),
                            tool_len=tuple(args.tool_len),
                            system_len=300, program_rate=args.program_rate, tool_median=args.tool_median,
                            tool_sigma=args.tool_sigma, tool_max=20.0, only_tenant=None, tools=args.tools)
    tok = _tokenizer(args.tokenizer)
    out = []
    for p in make_programs(ns):
        out.append({"id": p.program_id, "kind": p.kind, "start": p.start_delay,
                    "first": tok.encode(p.first_prompt), "tools": [tok.encode(t) for t in p.tool_results],
                    "gaps": p.tool_gaps, "tool_names": p.tool_names})
    return out


def alone_jcts(args, coef: list[float], programs: list[dict]) -> list[float]:
    """Each program's job time alone on an idle server (its own session, nothing else in
    the cache): the time no order can beat, program by program."""
    jcts = []
    for p in programs:
        p = dict(p, start=0.0)
        Sim(args, coef).run([p])
        jcts.append(p["jct"])
    return jcts


def isolated(args, coef: list[float], programs: list[dict]) -> dict:
    """The percentiles of alone_jcts. Every program's time under any policy is at least its
    time alone, so each percentile here bounds that policy's percentile from below: FCFS's
    p99 over this p99 is the most any scheduler can gain on it."""
    jcts, kinds = alone_jcts(args, coef, programs), [p["kind"] for p in programs]

    def pct(kind, q):
        xs = [j for j, k in zip(jcts, kinds) if kind is None or k == kind]
        return round(percentile(xs, q), 1) if xs else None
    return {"jct_p50_s": pct(None, 0.5), "jct_p99_s": pct(None, 0.99), "short_p50_s": pct("short", 0.5),
            "long_p50_s": pct("long", 0.5)}


def run(args) -> int:
    with open(args.model_json) as f:
        coef = json.load(f)["coef"]
    if args.isolated:
        report = isolated(args, coef, load(args))
    else:
        report = Sim(args, coef).run(load(args))
    report["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(json.dumps(report))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(required=True)
    f = sub.add_parser("fit", help="time the engine's steps on this machine and fit the step-time model")
    f.add_argument("--out", required=True)
    f.add_argument("--kv-gib", type=float, default=0.5)
    f.set_defaults(func=fit)
    r = sub.add_parser("run", help="replay the agent load in simulated time")
    r.add_argument("--model-json", required=True, help="the step-time model from `fit`")
    r.add_argument("--tokenizer", default="smollm2-135m")
    r.add_argument("--programs", type=int, default=96)
    r.add_argument("--program-rate", type=float, default=0.5)
    r.add_argument("--tool-median", type=float, default=1.0)
    r.add_argument("--short-frac", type=float, default=0.7, help="share of short programs (2-3 calls; else 8-12)")
    r.add_argument("--tool-len", type=int, nargs=2, default=(60, 120), metavar=("LO", "HI"),
                   help="tokens of a tool result")
    r.add_argument("--tool-sigma", type=float, default=1.0)
    r.add_argument("--tools", type=int, default=0, help="named tools of different medians (bench agents --tools)")
    r.add_argument("--tool-hints", action="store_true",
                   help="tell the scheduler each call's tool as it ends (tool-aware session TTLs)")
    r.add_argument("--output-len", type=int, default=32)
    r.add_argument("--kv-gib", type=float, default=0.25)
    r.add_argument("--policy", default="fcfs")
    r.add_argument("--sessions", action="store_true")
    r.add_argument("--starvation-s", type=float, default=30.0)
    r.add_argument("--max-pinned-fraction", type=float, default=0.5)
    r.add_argument("--max-num-batched-tokens", type=int, default=256)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--variant", default=None, choices=sorted(VARIANTS))
    r.add_argument("--isolated", action="store_true",
                   help="run each program alone (the lower bound on every program's job time)")
    r.add_argument("--slowdown", type=float, default=1.0, help="scale the modelled step times")
    r.add_argument("--offload-gib", type=float, default=0.0, help="a host KV tier of this many GiB (0: none)")
    r.add_argument("--offload-dtype", default="int8", choices=sorted(OFFLOAD_BLOCK_BYTES))
    r.add_argument("--offload-save-us", type=float, default=362.0, help="one block saved to the tier")
    r.add_argument("--offload-load-us", type=float, default=274.0, help="one block copied back")
    r.set_defaults(func=run)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
