"""What a KV block costs to offload and to bring back, per tier and form, against what
recomputing it costs: the figures behind the offload index's cost model
(core/kv_offload.py) and the simulator's reload time (agents_sim.py --offload-gib).

The default model's cache shape (SmolLM2-135M: 30 layers, 3 kv heads of 64, blocks of 16
tokens, bf16) in a pool of 512 blocks; the real OffloadStore moves REPEATS blocks each way,
8 per call (host: save, load; disk: spill, load_disk through the page cache of a file in
--dir).
The recompute figure is one prompt block's share of an engine step, measured on the
default model: a 256-token prompt step, its time / 16.

    .venv/bin/python benchmarks/kv_offload_copy.py [--dir /tmp] [--repeats 2000]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

import torch

from sluice.worker.kv_offload_store import OffloadStore

LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
RUN = 8  # blocks per execute() call


def copy_costs(compress: bool, repeats: int, disk_dir: str) -> dict:
    num_blocks = 512
    kv = [(torch.randn(HEADS, num_blocks + 1, BLOCK, HEAD_DIM).to(torch.bfloat16),
           torch.randn(HEADS, num_blocks + 1, BLOCK, HEAD_DIM).to(torch.bfloat16)) for _ in range(LAYERS)]
    slots = 256
    store = OffloadStore(kv, slots, compress, disk_dir, slots)
    out = {"block_bytes": store.block_bytes}
    for kind, make in (("save", lambda i: ("save", i % num_blocks, i % slots, b"")),
                       ("load", lambda i: ("load", i % slots, (i * 7) % num_blocks, b"")),
                       ("spill", lambda i: ("spill", i % slots, i % slots, b"")),
                       ("load_disk", lambda i: ("load_disk", i % slots, (i * 7) % num_blocks, b""))):
        times = []
        for rep in range(5):
            ops = [make(i) for i in range(repeats // 5)]
            t0 = time.perf_counter()
            for i in range(0, len(ops), RUN):  # a step's evictions or reloads: a few blocks at a time
                assert not store.execute(ops[i:i + RUN], kv)
            times.append((time.perf_counter() - t0) / len(ops))
        out[f"{kind}_us"] = round(1e6 * statistics.median(times), 1)
    store.close()
    return out


def recompute_cost() -> float:
    """Seconds of a 256-token prompt step of the default model, per 16-token block."""
    from sluice import LLM, SamplingParams
    llm = LLM(kv_cache_memory=0.25, speculative_method=None, enable_prefix_caching=False)
    prompt = list(range(1000, 1256))
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) / (256 / BLOCK)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder for the disk tier's file (default: a temporary one)")
    ap.add_argument("--repeats", type=int, default=2000)
    ap.add_argument("--no-recompute", action="store_true", help="skip the model's prompt step")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        report = {"exact": copy_costs(False, args.repeats, d), "int8": copy_costs(True, args.repeats, d)}
    if not args.no_recompute:
        report["recompute_block_us"] = round(1e6 * recompute_cost(), 1)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
