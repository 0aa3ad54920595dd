"""Two builds of the C++ kernels side by side in one engine: the working tree's and a git
revision's (`--base`), swapped every engine step on the served c32 workload (64 requests
of ~210-token prompts and 128 output tokens, greedy, at most 32 running; `--max-num-seqs 1`
for one stream's decode). Step times are
kept per build and per kind of step (decode-only, or with prompt chunks); because the
builds alternate step by step they see the same spells of this shared machine, which
separate runs minutes apart do not.

    python benchmarks/ab_kernels.py --base HEAD~1 --rounds 4 \\
        '{"quantization": "w8a8", "kv_cache_dtype": "int8"}'

The swap covers the decoder stack (every layer) and the greedy LM head; the base build
is compiled from the revision's kernel sources under another module name (~35 s
the first time). Both builds must pack weights the same way.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from sluice import LLMEngine, SamplingParams
from sluice.backends.cpu.backend import StackForward, build_stack
from sluice.bench.workload import make_prompts
from sluice.backends.cpu import x86 as kernels

KERNEL_DIR = "src/sluice/backends/cpu/x86"


def build_at(revision: str, isa: str):
    """The kernels as they were at `revision`, built for `isa`, as a module of their own."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    sha = subprocess.run(["git", "rev-parse", "--short", revision], capture_output=True, text=True, check=True,
                         cwd=root).stdout.strip()
    src = Path(tempfile.mkdtemp(prefix=f"sluice_kernels_{sha}_"))
    listing = subprocess.run(["git", "ls-tree", "-r", "--name-only", sha, "--", KERNEL_DIR], capture_output=True,
                             text=True, check=True, cwd=root).stdout.split()
    for path in listing:
        blob = subprocess.run(["git", "show", f"{sha}:{path}"], capture_output=True, check=True, cwd=root).stdout
        dest = src / Path(path).relative_to(KERNEL_DIR)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(blob)
    # The build of the variant this engine runs (a build is named by its sources' content).
    return kernels.build(isa, src), sha


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("options", nargs="?", default="{}", help="JSON of engine options (LLMEngine.from_kwargs)")
    ap.add_argument("--base", default="HEAD", help="git revision of the other build")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32, help="requests running at once (1: one stream's decode)")
    args = ap.parse_args()
    engine = LLMEngine.from_kwargs(max_num_seqs=args.max_num_seqs, **json.loads(args.options))
    model = engine.runner.model
    if getattr(model, "fast_forward", None) is None:
        raise SystemExit("these engine options do not run the decoder stack; nothing to compare")
    base, sha = build_at(args.base, engine.backend.isa)
    head = getattr(model, "greedy_head", None)
    builds = {"tree": (model.fast_forward, head),
              sha: (StackForward(build_stack(model, base)),
                    None if head is None else dataclasses.replace(head, kernels=base))}
    names = list(builds)
    times = {(b, kind): [] for b in names for kind in ("decode", "mixed")}
    execute = engine.runner.execute
    count = [0]

    def timed(plan):
        i = count[0]
        count[0] += 1
        name = names[(i + i // 2) % 2]  # ABBA order, so neither build always follows the other
        model.fast_forward, model.greedy_head = builds[name]
        t = time.perf_counter()
        result = execute(plan)
        kind = "mixed" if any(len(e.token_ids) > 1 for e in plan.scheduled) else "decode"
        times[(name, kind)].append(1e3 * (time.perf_counter() - t))
        return result

    engine.runner.execute = timed

    def median(values: list) -> float:  # nan before a build has run a step of that kind
        return statistics.median(values) if values else float("nan")

    for r in range(args.rounds):
        for j, prompt in enumerate(make_prompts(engine.tokenizer, args.requests, 200, 220, seed=100 + r)):
            engine.add_request(f"r{r}_{j}", prompt,
                               SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        tok_s = args.requests * args.output_len / (time.perf_counter() - t0)
        print(f"round {r}: {tok_s:.1f} tok/s (both builds); step medians so far: " + "; ".join(
            f"{b} decode {median(times[(b, 'decode')]):.2f} ms, mixed "
            f"{median(times[(b, 'mixed')]):.2f} ms" for b in names), flush=True)
    for kind in ("decode", "mixed"):
        a, b = (median(times[(n, kind)]) for n in names)
        print(f"{kind}: {names[0]} {a:.2f} ms ({len(times[(names[0], kind)])} steps), {names[1]} {b:.2f} ms "
              f"({len(times[(names[1], kind)])} steps), ratio {a / b:.3f}")


if __name__ == "__main__":
    main()
