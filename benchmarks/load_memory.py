"""What an engine holds after its load: the weights (sluice's `weights ... MB in memory`,
every packed form counted once), the process's resident memory after the load (VmRSS) and
its peak during it (VmHWM), and the time from a bare interpreter to a loaded engine. One
process per mode, so that no mode's memory counts in another's.

    python benchmarks/load_memory.py [--model smollm2-135m] [--modes auto,none]
        [--kv-cache-memory 1] [--rounds 2]

Modes are `--quantization` values (auto: the default; none: full precision).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, time
t0 = time.perf_counter()
from sluice.engine.llm_engine import LLMEngine
q = {quantization!r}
e = LLMEngine.from_kwargs(model={model!r}, kv_cache_memory={kv}, **({{}} if q == "auto" else {{"quantization": None if q == "none" else q}}))
start = time.perf_counter() - t0
status = open("/proc/self/status").read()
kb = lambda key: int(status.split(key + ":")[1].split()[0])
kv = sum(t.numel() * t.element_size() for pair in e.runner.kv_tensors for t in pair)
print(json.dumps({{"weights_mb": e.weight_bytes / 1e6, "kv_mb": kv / 1e6, "rss_mb": kb("VmRSS") / 1e3,
                  "peak_mb": kb("VmHWM") / 1e3, "start_s": start}}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--modes", default="auto,none")
    ap.add_argument("--kv-cache-memory", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    rows = {}
    for _ in range(args.rounds):
        for mode in args.modes.split(","):
            code = CHILD.format(quantization=mode, model=args.model, kv=args.kv_cache_memory)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=dict(os.environ, HF_HUB_OFFLINE="1"))
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            rows.setdefault(mode, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print("| mode | weights (MB) | KV cache (MB) | RSS after load (MB) | peak RSS (MB) | start (s) |")
    print("|---|---|---|---|---|---|")
    for mode, runs in rows.items():
        med = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in runs[0]}
        print(f"| {mode} | {med['weights_mb']:.1f} | {med['kv_mb']:.0f} | {med['rss_mb']:,.0f} | {med['peak_mb']:,.0f} "
              f"| {min(r['start_s'] for r in runs):.1f}-{max(r['start_s'] for r in runs):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
