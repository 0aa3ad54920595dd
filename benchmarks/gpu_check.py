"""The GPU check, one command (benchmarks/gpu_check.sh runs it on a machine with an NVIDIA
GPU): correctness of the CUDA backend on the GPU, then its speed on two model shapes with
random weights (nothing downloaded; speed does not depend on the values), beside HF
transformers' own continuous batching on the same GPU, printed as one table and written as
JSON.

  (a) the Triton kernel tests and the CUDA backend's engine tests on the GPU (compiled, not
      interpreted: attention, FP8, the GEMV; FP8 weights, cache and checkpoints, offloading),
      and the engine's greedy tokens on the GPU against the CPU engine's on the same
      float32 checkpoint;
  (b) a SmolLM2-135M-shaped model (the default model's shape), served: c1 / c32 / c128;
  (c) a Llama-3.1-8B-shaped model, offline and served: c1 / c32 / c128, 512-token prompts,
      256-token outputs, bf16 and FP8 weights (--quantization fp8); offline also with
      asynchronous scheduling off at c1 / c32; where a decode step's time goes at c1 and
      c32 (GPU kernels against the step's wall time, from torch's profiler), and the
      GEMV's calibration against cuBLAS per layer shape (the engine's log);
  (d) transformers' continuous batching on the 8B shape: c1 and c32.

Each model folder holds a config.json and the tokenizer files (`--tokenizer-dir`, e.g. the
converted SmolLM2 tokenizer in ~/.cache/sluice/gguf); the engines load it with
load_format="dummy" (random weights made on the device). `--device cpu --quick` runs the
same plumbing on CPU tensors under Triton's interpreter with tiny shapes (a dry run).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, intermediate_size=1536,
               num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
               bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
TINY = dict(SMOLLM2, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024)


def model_folder(out: Path, name: str, config: dict, tokenizer_dir: Path) -> Path:
    """A folder with `config` and the tokenizer's files: what load_format='dummy' needs."""
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy(f, folder / f.name)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, timeout=timeout, text=True, capture_output=True, **kw)


# -- (a) correctness --------------------------------------------------------------
def check_correctness(args, out: Path) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    res = run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "unit" / "test_triton_kernels.py"),
               str(ROOT / "tests" / "unit" / "test_triton_fp8.py")], 600, env=env, cwd=ROOT)
    tail = (res.stdout + res.stderr).strip().splitlines()[-1:] or ["(no output)"]
    # The engine's FP8 paths on the GPU (the tiny model): FP8 weights against the dequantized
    # checkpoint, an FP8 checkpoint as stored, the FP8 cache through chunking, preemption
    # and offloading over pinned memory, with graphs and the overlap loop on.
    eng = run([sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
               str(ROOT / "tests" / "model" / "test_cuda_backend.py"), "-k", "fp8",
               "--tokenizer-dir", str(args.tokenizer_dir.resolve())], 600, env=env, cwd=ROOT)
    eng_tail = (eng.stdout + eng.stderr).strip().splitlines()[-1:] or ["(no output)"]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from sluice import LLM, SamplingParams
    shape = TINY if args.quick else SMOLLM2
    folder = model_folder(out, "checkpoint-f32", {**shape, "torch_dtype": "float32"}, args.tokenizer_dir)
    torch.manual_seed(0)
    cfg = {k: v for k, v in shape.items() if k not in ("architectures", "model_type")}
    LlamaForCausalLM(LlamaConfig(**cfg)).save_pretrained(folder)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 40000) for _ in range(rng.randint(5, 200))] for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cpu = LLM(model=str(folder), dtype="float32", num_blocks=512, speculative_method=None)
    want = [o.outputs[0].token_ids for o in cpu.generate(prompts, params, use_tqdm=False)]
    gpu = LLM(model=str(folder), dtype="float32", device=args.device, num_blocks=512, speculative_method=None)
    got = [o.outputs[0].token_ids for o in gpu.generate(prompts, params, use_tqdm=False)]
    same = sum(a == b for a, b in zip(want, got))
    return {"kernel_tests": tail[0], "fp8_engine_tests": eng_tail[0], "greedy_equal": f"{same}/{len(prompts)}",
            "plan": gpu.engine.backend.line()}


# -- (b), (c) sluice ----------------------------------------------------------------
def offline(args, folder: Path, concurrencies: list[int], requests: list[int], prompt_len: int,
            output_len: int, async_scheduling: bool = True, quantization: str | None = None,
            profile_rows: tuple = ()) -> dict:
    """One engine (its kernels compiled and graphs captured once); for each concurrency c a
    closed loop that keeps c requests in flight until `requests` are done. async_scheduling:
    the overlap loop (the GPU's default) or the plain one, to measure what it is worth.
    quantization: 'fp8' for FP8 weights. profile_rows: decode batch sizes whose steps are
    profiled (decode_profile)."""
    import torch

    from sluice import LLMEngine, SamplingParams
    engine = LLMEngine.from_kwargs(model=str(folder), device=args.device, load_format="dummy",
                                   max_num_seqs=max(concurrencies), speculative_method=None,
                                   max_model_len=prompt_len + output_len + 16, async_scheduling=async_scheduling,
                                   quantization=quantization)
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine.add_request("warm", [rng.randrange(3, 40000) for _ in range(prompt_len)], params.clone(max_tokens=4))
    while engine.has_unfinished_requests():
        engine.step()
    rows = {"plan": engine.backend.line()}
    for c, n in zip(concurrencies, requests):
        engine.backend.synchronize()
        t0 = time.perf_counter()
        sent = tokens = 0
        while sent < min(c, n):
            engine.add_request(f"c{c}-{sent}", [rng.randrange(3, 40000) for _ in range(prompt_len)], params)
            sent += 1
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    tokens += len(o.outputs[0].token_ids)
                    if sent < n:
                        engine.add_request(f"c{c}-{sent}", [rng.randrange(3, 40000) for _ in range(prompt_len)],
                                           params)
                        sent += 1
        engine.backend.synchronize()
        rows[c] = {"output_tok_per_s": tokens / (time.perf_counter() - t0)}
    for c in profile_rows:
        rows[f"profile_c{c}"] = decode_profile(engine, rng, c, prompt_len)
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def decode_profile(engine, rng, rows: int, prompt_len: int, steps: int = 8) -> dict:
    """Where a decode step's time goes at `rows` rows: `rows` requests decoding, then
    `steps` steps under torch's profiler: the wall time a step, the GPU kernels' time a step
    (the rest is gaps: launches, host work the GPU waits for), and the kernels that take
    the most."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from sluice import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=steps + 12, ignore_eos=True)
    ids = [f"prof{rows}-{i}" for i in range(rows)]
    for rid in ids:
        engine.add_request(rid, [rng.randrange(3, 40000) for _ in range(prompt_len)], params.clone())
    for _ in range(8):  # every prompt in, the batch decoding
        engine.step()
    engine.backend.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        engine.backend.synchronize()
        wall = (time.perf_counter() - t0) / steps
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu = sum(e.self_device_time_total for e in kernels) / steps / 1e3  # µs -> ms
    top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()
    return {"rows": rows, "step_ms": wall * 1e3, "gpu_kernels_ms": gpu, "gaps_ms": wall * 1e3 - gpu,
            "top_kernels": [(e.key[:60], round(e.self_device_time_total / steps / 1e3, 3)) for e in top]}


def served(args, folder: Path, concurrencies: list[int], requests: list[int], prompt_len: int, output_len: int,
           out: Path, name: str, extra: tuple = ()) -> list[dict]:
    port = free_port()
    log = open(out / f"{name}-server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "sluice.entrypoints.cli", "serve", "--model", str(folder),
                               "--device", args.device, "--load-format", "dummy", "--port", str(port),
                               "--served-model-name", "sluice",
                               "--speculative-method", "off", "--max-model-len", str(prompt_len + output_len + 16),
                               "--max-num-seqs", str(max(concurrencies)), *extra],
                              stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    try:
        import httpx
        deadline = time.time() + 600
        while True:
            assert server.poll() is None, (out / f"{name}-server.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.time() < deadline, "the server did not come up"
            time.sleep(1)
        rows = []
        for c, n in zip(concurrencies, requests):
            report = out / f"{name}-c{c}.json"
            res = run([sys.executable, "-m", "sluice.entrypoints.cli", "bench", "serve", "--url",
                       f"http://127.0.0.1:{port}", "--model", "sluice", "--tokenizer", str(folder), "--concurrency",
                       str(c), "--requests", str(n), "--input-len", str(prompt_len), "--output-len", str(output_len),
                       "--json", str(report)], 900)
            if res.returncode != 0:
                rows.append({"concurrency": c, "error": (res.stderr or res.stdout)[-500:]})
                continue
            r = json.loads(report.read_text())["runs"][0]
            rows.append({"concurrency": c, "output_tok_per_s": r["output_tok_per_s"], "ttft_p50_s": r["ttft_p50_s"],
                         "tpot_p50_s": r["tpot_p50_s"]})
        return rows
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


# -- (d) transformers --------------------------------------------------------------
def transformers_cb(args, folder: Path, concurrency: int, requests: int, prompt_len: int, output_len: int) -> dict:
    """HF transformers' continuous batching (the API ../shared/gpu.md used), random bf16 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints
    cfg = AutoConfig.from_pretrained(str(folder))
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    gen = GenerationConfig(max_new_tokens=output_len, do_sample=False, eos_token_id=-1)
    manager = model.init_continuous_batching(generation_config=gen, workload_hints=WorkloadHints(
        max_prompt_length=prompt_len, max_generated_length=output_len, num_requests=requests))
    manager.warmup()
    manager.start()
    rng = random.Random(2)
    t0 = time.perf_counter()
    ids = [[rng.randrange(3, 40000) for _ in range(prompt_len)] for _ in range(requests)]
    sent, done, tokens = 0, 0, 0
    while sent < min(concurrency, requests):
        manager.add_request(ids[sent], request_id=str(sent), max_new_tokens=output_len)
        sent += 1
    while done < requests:
        r = manager.get_result(timeout=1)
        if r is None:
            continue
        done += 1
        tokens += len(r.generated_tokens)
        if sent < requests:
            manager.add_request(ids[sent], request_id=str(sent), max_new_tokens=output_len)
            sent += 1
    dt = time.perf_counter() - t0
    manager.stop()
    del model
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return {"concurrency": concurrency, "output_tok_per_s": tokens / dt}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-dir", type=Path, required=True,
                    help="a folder with tokenizer files (e.g. ~/.cache/sluice/gguf/SmolLM2-...)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "gpu_check")
    ap.add_argument("--quick", action="store_true", help="tiny shapes and few requests: a dry run of the plumbing")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: a,b,c,d")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    t_start = time.time()
    report: dict = {"device": args.device}
    if args.device.startswith("cuda"):
        import torch
        report["gpu"] = torch.cuda.get_device_name(0)
    if "a" not in skip:
        report["correctness"] = check_correctness(args, args.out)
        print(json.dumps(report["correctness"]), flush=True)
    small = TINY if args.quick else SMOLLM2
    big = TINY if args.quick else LLAMA_8B
    p_len, o_len = (32, 16) if args.quick else (512, 256)
    cs = [1, 4] if args.quick else [1, 32, 128]
    reqs = [2, 8] if args.quick else [4, 64, 256]
    # FP8 weights run on the CUDA backend only (the CPU dry run refuses them).
    fp8 = args.device.startswith("cuda")
    if "b" not in skip:
        folder = model_folder(args.out, "smollm2-shape", small, args.tokenizer_dir)
        report["smollm2_served"] = served(args, folder, cs, reqs, 210 if not args.quick else 32,
                                          128 if not args.quick else 16, args.out, "smollm2")
        print(json.dumps(report["smollm2_served"]), flush=True)
    folder = model_folder(args.out, "llama8b-shape", big, args.tokenizer_dir)
    if "c" not in skip:
        report["llama8b_offline"] = offline(args, folder, cs, reqs, p_len, o_len, profile_rows=cs[:2])
        print(json.dumps(report["llama8b_offline"]), flush=True)
        if fp8:
            # c1 and c32 offline (c128 served below): the check's 8 minutes.
            report["llama8b_fp8_offline"] = offline(args, folder, cs[:2], reqs[:2], p_len, o_len,
                                                    quantization="fp8", profile_rows=cs[:2])
            print(json.dumps(report["llama8b_fp8_offline"]), flush=True)
        # The overlap loop's worth: the same closed loops at c1 and c32 with it off.
        report["llama8b_offline_sync"] = offline(args, folder, cs[:2], reqs[:2], p_len, o_len,
                                                 async_scheduling=False)
        print(json.dumps(report["llama8b_offline_sync"]), flush=True)
        report["llama8b_served"] = served(args, folder, cs, reqs, p_len, o_len, args.out, "llama8b")
        print(json.dumps(report["llama8b_served"]), flush=True)
        if fp8:
            report["llama8b_fp8_served"] = served(args, folder, cs, reqs, p_len, o_len, args.out, "llama8b-fp8",
                                                  ("--quantization", "fp8"))
            print(json.dumps(report["llama8b_fp8_served"]), flush=True)
    if "d" not in skip and not args.quick:
        report["transformers_cb"] = [transformers_cb(args, folder, c, n, p_len, o_len)
                                     for c, n in ((1, 2), (32, 32))]
        print(json.dumps(report["transformers_cb"]), flush=True)
    report["seconds"] = time.time() - t_start
    (args.out / "report.json").write_text(json.dumps(report, indent=1))
    print_table(report)
    return 0


def print_table(report: dict) -> None:
    print("\n| what | concurrency | output tok/s | TTFT p50 | TPOT p50 |\n|---|---|---|---|---|")
    for key in ("smollm2_served", "llama8b_served", "llama8b_fp8_served"):
        for r in report.get(key, []):
            if "error" in r:
                print(f"| {key} | {r['concurrency']} | error | | |")
                continue
            print(f"| {key} | {r['concurrency']} | {r['output_tok_per_s']:.1f} | {r['ttft_p50_s'] or 0:.3f} s | "
                  f"{1e3 * (r['tpot_p50_s'] or 0):.2f} ms |")
    for key in ("llama8b_offline", "llama8b_fp8_offline", "llama8b_offline_sync"):
        for c, r in report.get(key, {}).items():
            if c != "plan" and not str(c).startswith("profile"):
                print(f"| {key} | {c} | {r['output_tok_per_s']:.1f} | | |")
    print("\n| decode step | rows | step ms | GPU kernels ms | gaps ms |\n|---|---|---|---|---|")
    for key in ("llama8b_offline", "llama8b_fp8_offline"):
        for c, r in report.get(key, {}).items():
            if str(c).startswith("profile"):
                print(f"| {key} | {r['rows']} | {r['step_ms']:.2f} | {r['gpu_kernels_ms']:.2f} | {r['gaps_ms']:.2f} |")
    for r in report.get("transformers_cb", []):
        print(f"| transformers_cb | {r['concurrency']} | {r['output_tok_per_s']:.1f} | | |")
    if "correctness" in report:
        print(f"\ncorrectness: {report['correctness']}")
    print(f"total {report['seconds']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
