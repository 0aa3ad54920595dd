"""Where speculative decoding pays on this machine: the wall time of a decode step with
R running requests each verifying k drafted tokens, t(R, k), against plain decoding, t(R, 0).

A request whose drafts are each accepted with probability a (in turn) emits
E(a, k) = 1 + a + ... + a^k tokens per step, so speculation lowers TPOT exactly when
E(a, k) > t(R, k) / t(R, 0). The script prints that ratio and the acceptance rate a* at
which it breaks even, per R and k: the measurement behind spec/gate.py's default.

    .venv/bin/python benchmarks/spec_crossover.py [--dtype bfloat16] [--rs 1,2,4,8,16,32] [--ks 1,2,4,8]

Drafts here are the request's last token repeated (almost always rejected): only the
step's cost is measured, whatever the drafts.
"""
from __future__ import annotations

import argparse
import statistics
import time

from sluice import LLM, SamplingParams
from sluice.spec.gate import expected_tokens
from sluice.spec.speculator import Speculator


class RepeatLast:
    """A proposer that always drafts k tokens (the last one again)."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, req, k):
        return [req.output_token_ids[-1] if req.output_token_ids else req.prompt_token_ids[-1]] * min(k, self.k)

    def request_finished(self, req):
        pass


def step_times(llm: LLM, r: int, k: int, steps: int) -> float:
    """Median wall seconds of a decode step with r requests verifying k drafts each."""
    eng = llm.engine
    spec: Speculator = eng.scheduler.spec
    spec.proposer = RepeatLast(k)
    spec.k = max(k, 1)
    base = "The history of the city is long and full of surprises. " * 20
    for i in range(r):
        eng.add_request(f"x{time.monotonic_ns()}-{i}", f"{i} {base}",
                        SamplingParams(temperature=0, max_tokens=steps * 4, ignore_eos=True))
    times = []
    while eng.has_unfinished_requests():
        plan_tokens = sum(x.num_tokens - x.num_computed_tokens for x in eng.scheduler.running)
        decodes_only = (eng.scheduler.running and plan_tokens == len(eng.scheduler.running)
                        and not eng.scheduler.waiting)
        t0 = time.perf_counter()
        eng.step()
        if decodes_only:
            times.append(time.perf_counter() - t0)
        if len(times) >= steps:
            for req in list(eng.scheduler.running):
                eng.abort(req.request_id)
            eng.step()
            break
    return statistics.median(times[2:])


def break_even(ratio: float, k: int) -> float | None:
    """The acceptance rate at which E(a, k) = ratio (None: not even at a = 1)."""
    if ratio <= 1:
        return 0.0
    if expected_tokens(1.0, k) < ratio:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < ratio else (lo, mid)
    return hi


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--rs", default="1,2,4,8,16,32")
    ap.add_argument("--ks", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, speculative_method="ngram", speculative_gate="always",
              num_speculative_tokens=16, max_num_batched_tokens=1024)
    ks = [int(k) for k in args.ks.split(",")]
    print(f"dtype {llm.engine.dtype}; median decode step ms, and t(R,k)/t(R,0) -> break-even acceptance")
    print("| R | t(R,0) ms | " + " | ".join(f"k={k}: ratio, a*" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for r in (int(x) for x in args.rs.split(",")):
        t0 = step_times(llm, r, 0, args.steps)
        cells = []
        for k in ks:
            tk = step_times(llm, r, k, args.steps)
            a = break_even(tk / t0, k)
            cells.append(f"{tk / t0:.2f}, {'never' if a is None else f'{a:.2f}'}")
        print(f"| {r} | {1e3 * t0:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
