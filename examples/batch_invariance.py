"""Show the difference between the default and the deterministic mode.

    .venv/bin/python examples/batch_invariance.py [--trials 5] [--dtype float32] [--quantization int8]

One greedy probe request, with logprobs, runs alone, then beside a crowd of other
requests arriving at different steps, under a small step budget (so its prompt is
chunked) and a small KV cache (so requests get preempted and recomputed). In each mode it
prints how many crowded runs gave bitwise the solo run's tokens and logprobs, and the
largest logprob difference seen.

The probe is a ~700-token document and a question. On a CPU with AVX-512 BF16 the
default bfloat16 mode runs the same batch-invariant kernels as deterministic mode for the
linear layers, norms and attention, so there the two usually agree; what the default does
not fix is RoPE's cos/sin (computed per batch) and, with int8 weights, which kernel a
step's row count selects (int8 at up to 8 rows, the dequantized bf16 weights above). In
float32 the default keeps torch's matmul and SDPA, whose results depend on the batch:
`--dtype float32` or `--quantization int8` shows the default mode's difference.
"""
from __future__ import annotations

import argparse
import random

from sluice import LLMEngine, SamplingParams
from sluice.bench.workload import make_prompts

QUESTION = "\n\nSummarise the text above in one sentence."
WORDS = "river stone market engine window garden silver theory quiet number paper storm".split()


def run(engine: LLMEngine, probe: list[int], crowd: list[tuple[int, str, int]]):
    """crowd: (arrival step, prompt, max_tokens) of the neighbours. Returns the probe's
    (token ids, per-token {token: logprob})."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    pending = sorted(crowd)
    # The probe arrives after the first neighbours: its prompt is chunked around their
    # decodes, and as the newest request it is the first to be preempted.
    probe_step = 3 if crowd else 0
    step, result, n = 0, None, 0
    while pending or engine.has_unfinished_requests() or step <= probe_step:
        if step == probe_step:
            engine.add_request("probe", probe, params)
        while pending and pending[0][0] <= step:
            _, prompt, max_tokens = pending.pop(0)
            engine.add_request(f"n{n}", prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
            n += 1
        for o in engine.step():
            if o.request_id == "probe" and o.finished:
                out = o.outputs[0]
                result = (out.token_ids, [{t: lp.logprob for t, lp in d.items()} for d in out.logprobs])
        step += 1
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None, choices=[None, "int8", "w8a8"])
    args = ap.parse_args()
    for deterministic in (False, True):
        engine = LLMEngine.from_kwargs(deterministic=deterministic, num_blocks=80, max_num_batched_tokens=64,
                                       dtype=args.dtype, quantization=args.quantization)
        tok = engine.tokenizer
        probe = make_prompts(tok, 1, 700, 700, seed=3)[0] + tok.encode(QUESTION, add_special_tokens=False)
        tokens, logprobs = run(engine, probe, [])
        rng = random.Random(0)
        same, worst = 0, 0.0
        for _ in range(args.trials):
            crowd = [(rng.choice([0, 0, rng.randint(1, 20)]), " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60))),
                      rng.randint(1, 30)) for _ in range(rng.randint(4, 24))]
            t, lps = run(engine, probe, crowd)
            same += (t, lps) == (tokens, logprobs)
            for a, b in zip(lps, logprobs):
                for tok in a.keys() & b.keys():
                    worst = max(worst, abs(a[tok] - b[tok]))
            if t != tokens:
                worst = float("inf")  # the text itself changed
        name = "deterministic" if deterministic else "default"
        print(f"{name:13s}: {same}/{args.trials} crowded runs bitwise equal to the solo run; "
              f"largest logprob difference {worst:.3g}"
              + (" (tokens differed)" if worst == float("inf") else ""))


if __name__ == "__main__":
    main()
