"""Command line: `sluice serve`, `sluice generate "prompt"`, `sluice chat` (interactive,
streaming), `sluice bench serve` (load generator for any OpenAI-compatible server) and
`sluice bench soak` (load and faults against one, reporting what broke)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import uuid

from sluice.backends.platform import CPU_ISAS
from sluice.config import DEFAULT_MODEL, SCHEDULING_POLICIES, parse_name_weights
from sluice.quantization import NAMES as QUANTIZATION_NAMES


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"model alias, Hugging Face folder or .gguf file (default: {DEFAULT_MODEL})")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache dtype; auto = bfloat16 where sluice's kernels run "
                        "(AVX2 or AVX-512 CPUs) and on GPUs, else float32")
    g.add_argument("--device", default="auto",
                   help="auto (default): cuda where torch sees a GPU, else cpu; or a torch device: cpu, cuda, cuda:N "
                        "(the startup's backend line says which runs)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="CUDA: the fraction of the GPU's memory the engine may use; the KV cache takes what the "
                        "weights and a step's activations leave of it (default 0.9; --num-blocks overrides)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, no CUDA graphs for decode steps")
    g.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="auto: the checkpoint's weights; dummy: random weights of the model's shape from its "
                        "config alone, made on the device (to measure speed; default auto)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", *QUANTIZATION_NAMES],
                   help="auto (default): a GGUF's quantized weights in their own form where the kernels run "
                        "(bfloat16 on the CPU: a Q4_1 file w4a8, other quantized files gguf), else none; none: full "
                        "precision; int8: weight-only int8 linear layers (bfloat16, CPU), faster single-stream decode; "
                        "w8a8: the same weights times int8-quantized activations (sluice's kernels), faster "
                        "batches and prompts; w4a8: 4-bit weights (Q4_1's form, a Q4_1 GGUF's own values) times "
                        "int8 activations, the fastest batches on AVX2 CPUs; gguf: a GGUF's own quantized blocks "
                        "(Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K; other types requantized to 8 bits) in every layer, "
                        "as llama.cpp computes them, at about the file's size in memory; fp8 (CUDA): e4m3 weights with a "
                        "scale per output channel times FP8 activations per token, half the bytes of bf16 "
                        "(docs/benchmarks.md has the quality cost of each)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length limit (default: the model's)")
    g.add_argument("--kv-cache-memory", type=float, default=1.0, help="GiB for the paged KV cache (default 1)")
    g.add_argument("--num-blocks", type=int, default=None, help="KV blocks, overriding --kv-cache-memory")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "fp8"],
                   help="auto: K and V in the model's dtype; int8: 8-bit K and V with a scale per token "
                        "(~1.9x the tokens per GiB, faster decode attention; bfloat16, sluice's CPU kernels); fp8: "
                        "e4m3 K and V with a scale per token (CUDA: the same gain on a GPU); docs/benchmarks.md "
                        "has their quality cost")
    g.add_argument("--kv-offload-memory", type=float, default=0.0,
                   help="GiB of host memory for KV blocks the cache evicts (prefix-cache and session blocks): a "
                        "later hit copies them back instead of recomputing them (default 0: off)")
    g.add_argument("--kv-offload-dir", default=None,
                   help="a folder for a disk tier below --kv-offload-memory (blocks the host tier lets go; one "
                        "file, checksummed per block, gone with the process)")
    g.add_argument("--kv-offload-disk-size", type=float, default=4.0,
                   help="GiB of the disk tier in --kv-offload-dir (default 4)")
    g.add_argument("--kv-offload-dtype", default="auto", choices=["auto", "exact", "int8"],
                   help="offloaded blocks' form: exact (the cache's bits), int8 (a bf16 cache compressed per "
                        "token and head, ~1.9x the blocks per GiB), auto (default): int8 for a bf16 cache "
                        "outside --deterministic, else exact")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most requests running at once (default 256)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default 256 on a CPU, 2048 on a GPU)")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="do not reuse cached KV blocks of repeated prompt prefixes")
    g.add_argument("--cpu-isa", default="auto", choices=list(CPU_ISAS),
                   help="build of sluice's CPU kernels to run: auto = the best this CPU executes; avx512_vnni, "
                        "avx2_vnni or avx2 force a lower build (e.g. on an AVX-512 machine); generic = none, torch's own ops")
    g.add_argument("--scheduling-policy", default="auto", choices=list(SCHEDULING_POLICIES),
                   help="who is admitted and preempted first: fcfs (arrival); priority (the request's priority, "
                        "lower first); program (the session whose calls have had the least service first, "
                        "Autellix's PLAS); fair (per-tenant fair shares of tokens, VTC); auto (default): program "
                        "while requests carrying a session_id are queued or running, else fcfs")
    g.add_argument("--starvation-timeout", type=float, default=30.0,
                   help="program policy: a call waiting this many seconds goes ahead of the rest (default 30)")
    g.add_argument("--session-ttl", type=float, default=30.0,
                   help="seconds a session's KV stays pinned after a call, until its own gaps set the TTL "
                        "(default 30; 0: no pinning)")
    g.add_argument("--session-ttl-max", type=float, default=300.0,
                   help="the longest a session's KV is pinned after a call (default 300)")
    g.add_argument("--max-pinned-fraction", type=float, default=0.5,
                   help="the most of the KV cache session pins may hold (default 0.5)")
    g.add_argument("--max-sessions", type=int, default=10000,
                   help="sessions remembered at most; past it the tenant with the most loses its longest idle one "
                        "(default 10000)")
    g.add_argument("--target-tpot-ms", type=float, default=None,
                   help="hold each step (so each running request's time per output token) to this many ms by "
                        "sizing the step's token budget from measured step times; fewer prompt tokens per step "
                        "when it would break (default: none, the fixed --max-num-batched-tokens)")
    g.add_argument("--max-stream-stall", type=float, default=None,
                   help="bound, in seconds, on how long a preempted stream waits for its next token: it is "
                        "resumed ahead of new requests, and once its last token is this old, running requests "
                        "that have made progress give way to it (default: none, it waits for free KV blocks)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="plan the next step and turn the last step's tokens into output while the device runs "
                        "the current one (default: on where it pays, a GPU; off on a CPU, where nothing overlaps)")
    g.add_argument("--tenant-weight", action="append", default=[], metavar="NAME=WEIGHT",
                   help="fair policy: a tenant's weight (default 1; repeatable)")
    g.add_argument("--grammar-cache-size", type=int, default=64,
                   help="structured outputs: compiled grammars kept for reuse (default 64)")
    g.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="structured outputs: seconds a grammar may take to compile before the request is "
                        "refused (default 10)")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="a thinking model's <think>...</think> format: its reasoning goes to reasoning_content (chat) "
                        "and a reasoning item (Responses), and structured outputs and tool calls apply to the answer "
                        "after it (default: off)")
    g.add_argument("--speculative-method", default="ngram", choices=["ngram", "suffix", "off"],
                   help="speculative decoding without a draft model: ngram = prompt lookup in the request's own "
                        "prompt and output; suffix = that and the tenant's recent outputs; off. Lossless; run only "
                        "in steps where the measured step times say it pays (default ngram)")
    g.add_argument("--num-speculative-tokens", type=int, default=8,
                   help="speculative decoding: tokens drafted per request and step at most (as many as the "
                        "match is long), 1-16 (default 8)")
    g.add_argument("--speculative-gate", default="auto", choices=["auto", "always"],
                   help="speculative decoding: auto = in steps where it pays by the measured step times and "
                        "acceptance rates; always = whenever a draft is found (default auto)")
    g.add_argument("--speculative-min-match", type=int, default=2,
                   help="speculative decoding: the fewest last tokens that must match for a draft (default 2)")
    g.add_argument("--suffix-cache-tokens", type=int, default=16384,
                   help="suffix speculation: each tenant's recent output tokens kept for drafting (default 16384)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the model over this many processes (ranks) on torch.distributed (gloo on a CPU): "
                        "attention by KV heads, the MLP by its intermediate size, one all-reduce per block; at most "
                        "the model's KV heads (default 1)")
    g.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: a request's tokens and logprobs are bitwise the same "
                        "whatever else shares its batch (docs/determinism.md)")
    lo = p.add_argument_group("LoRA adapters")
    lo.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                    help="PEFT LoRA adapter folders to serve, each picked by a request's `model` NAME (also "
                         "vLLM's JSON form '{\"name\": ..., \"path\": ...}'); listed by /v1/models")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve LoRA adapters even with no --lora-modules (for /v1/load_lora_adapter)")
    lo.add_argument("--max-loras", type=int, default=4,
                    help="adapters resident at once, also the most distinct adapters in one batch (default 4); "
                         "the others wait in host memory")
    lo.add_argument("--max-lora-rank", type=int, default=64, help="the largest adapter rank taken (default 64)")


def engine_kwargs(args) -> dict:
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len,
                gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                load_format=args.load_format,
                quantization=None if args.quantization == "none" else args.quantization,
                kv_cache_memory=args.kv_cache_memory, num_blocks=args.num_blocks, block_size=args.block_size,
                kv_cache_dtype=args.kv_cache_dtype, kv_offload_memory=args.kv_offload_memory,
                kv_offload_dir=args.kv_offload_dir, kv_offload_disk_size=args.kv_offload_disk_size,
                kv_offload_dtype=args.kv_offload_dtype,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                enable_prefix_caching=args.enable_prefix_caching, deterministic=args.deterministic,
                cpu_isa=args.cpu_isa, policy=args.scheduling_policy, starvation_s=args.starvation_timeout,
                session_ttl_s=args.session_ttl, session_ttl_max_s=args.session_ttl_max,
                max_pinned_fraction=args.max_pinned_fraction, max_sessions=args.max_sessions,
                target_tpot_ms=args.target_tpot_ms, max_stream_stall_s=args.max_stream_stall,
                async_scheduling=args.async_scheduling,
                grammar_cache_size=args.grammar_cache_size,
                grammar_compile_timeout_s=args.grammar_compile_timeout, reasoning_parser=args.reasoning_parser,
                speculative_method=None if args.speculative_method == "off" else args.speculative_method, num_speculative_tokens=args.num_speculative_tokens,
                speculative_gate=args.speculative_gate, speculative_min_match=args.speculative_min_match,
                suffix_cache_tokens=args.suffix_cache_tokens, tensor_parallel_size=args.tensor_parallel_size,
                tenant_weights=parse_name_weights(args.tenant_weight, "--tenant-weight"),
                enable_lora=args.enable_lora, lora_modules=parse_lora_modules(args.lora_modules),
                max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """--lora-modules items (NAME=PATH, or vLLM's JSON object with name and path) as a dict;
    ValueError naming a bad or repeated item."""
    out: dict[str, str] = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                spec = json.loads(item)
                name, path = spec["name"], spec["path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-modules: {item!r} is not a JSON object with \"name\" and \"path\"") from None
        else:
            name, sep, path = item.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules takes NAME=PATH, got {item!r}")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"--lora-modules: {item!r} needs a name and a path")
        if name in out:
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out[name] = path
    return out


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate at most (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args):
    from sluice.sampling_params import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=args.seed, stop=args.stop)


def stream(engine, request_id: str, prompt, params, out=sys.stdout) -> str:
    """Run one request to the end, printing text as it is produced."""
    engine.add_request(request_id, prompt, params)
    shown = 0
    text = ""
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != request_id:
                continue
            text = o.outputs[0].text
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    out.write("\n")
    return text


def cmd_generate(args) -> int:
    from sluice.engine.llm_engine import LLMEngine
    params = sampling_params(args)  # bad flags fail before the model loads
    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    if args.chat_template:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        prompt = args.prompt
    stream(engine, "generate", prompt, params)
    return 0


def cmd_chat(args) -> int:
    from sluice.engine.llm_engine import LLMEngine
    params = sampling_params(args)  # bad flags fail before the model loads
    engine = LLMEngine.from_kwargs(**engine_kwargs(args))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("sluice chat: type a message, Ctrl-D or /exit to quit, /reset to clear the conversation.",
          file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.encode_chat(messages)
        try:
            reply = stream(engine, f"chat-{uuid.uuid4().hex}", prompt, params)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def cmd_serve(args) -> int:
    from sluice.entrypoints.openai.api_server import ServerConfig, serve
    from sluice.entrypoints.openai.serving import ServingLimits
    name = args.served_model_name or args.model
    for flag, value, low in (("--max-waiting", args.max_waiting, 1), ("--max-n", args.max_n, 1),
                             ("--max-request-bytes", args.max_request_bytes, 1024),
                             ("--request-timeout", args.request_timeout, 0),
                             ("--shutdown-grace", args.shutdown_grace, 0)):
        if not value >= low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if args.max_queue_wait is not None and not args.max_queue_wait > 0:
        raise ValueError(f"--max-queue-wait must be > 0 seconds, got {args.max_queue_wait}")
    limits = ServingLimits(max_waiting=args.max_waiting, max_n=args.max_n,
                           request_timeout=args.request_timeout or None, max_queue_wait=args.max_queue_wait)
    from sluice.entrypoints.openai.tenants import load_tenants
    tenants = load_tenants(args.tenants) if args.tenants else []
    kwargs = engine_kwargs(args)
    # The file's weights, under the flags' (a flag names a tenant explicitly).
    kwargs["tenant_weights"] = {**{t.name: t.weight for t in tenants}, **kwargs["tenant_weights"]}
    config = ServerConfig(host=args.host, port=args.port, served_model_name=name, api_key=args.api_key,
                          tenants=tenants, limits=limits, max_request_bytes=args.max_request_bytes,
                          shutdown_grace_s=args.shutdown_grace, enable_weight_updates=args.enable_weight_updates,
                          enable_lora_updates=args.enable_lora_updates)
    # These hand the engine objects made in the server's process (a checkpoint's tensors,
    # an adapter read off the engine thread), or run whole servers as Ray replicas: they
    # keep the engine in a thread of the server's process.
    one_process = [flag for flag, on in (
        ("--enable-weight-updates", args.enable_weight_updates), ("--enable-lora-updates", args.enable_lora_updates),
        ("--data-parallel-size > 1", args.data_parallel_size > 1 or args.ray_address is not None)) if on]
    if args.engine_process and one_process:
        raise ValueError(f"--engine-process does not take {one_process[0]}: leave it out (or pass "
                         "--no-engine-process) to run the engine in the server's process")
    config.engine_process = not one_process if args.engine_process is None else args.engine_process
    log_level = "info" if args.log_level == "WARNING" else args.log_level
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    if args.data_parallel_size > 1 or args.ray_address is not None:
        from sluice.entrypoints.router.app import DataParallelConfig, serve_data_parallel
        from sluice.entrypoints.router.policy import RouterPolicy
        RouterPolicy(1, args.router_policy, args.router_cache_threshold)  # bad settings fail before Ray starts
        dp = DataParallelConfig(size=args.data_parallel_size, ray_address=args.ray_address, policy=args.router_policy,
                                replica_cpus=args.replica_cpus, cache_threshold=args.router_cache_threshold,
                                balance_abs=args.router_balance_abs, balance_rel=args.router_balance_rel)
        return serve_data_parallel(kwargs, config, dp, log_level)
    return serve(kwargs, config, log_level=log_level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sluice", description="LLM inference with continuous batching")
    parser.add_argument("--log-level", default="INFO",
                        help="INFO (default) logs the start: the backend plan, the KV cache, the load time")
    sub = parser.add_subparsers(dest="command", required=True)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, metrics)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port to bind (default 8000)")
    srv.add_argument("--served-model-name", default=None,
                     help="the model name clients send and /v1/models lists (default: --model)")
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1/* (default: no key)")
    srv.add_argument("--tenants", default=None, metavar="FILE",
                     help="JSON file of tenants: API keys, each a tenant of its own, and fair-share weights "
                          "(entrypoints/openai/tenants.py has the format)")
    srv.add_argument("--max-waiting", type=int, default=128,
                     help="sequences (prompts x n) allowed to wait for a seat; past it new requests get HTTP 429 "
                          "+ Retry-After, and a request with more sequences than this gets 400 (default 128)")
    srv.add_argument("--max-queue-wait", type=float, default=None,
                     help="seconds a request may wait for its first step; past it, 429 with a Retry-After estimated "
                          "from how fast the queue drains (default: no bound)")
    srv.add_argument("--max-n", type=int, default=16, help="the most samples (n) one request may ask for (default 16)")
    srv.add_argument("--request-timeout", type=float, default=600.0,
                     help="seconds a request may wait and run in all; past it, it ends with an error and its KV "
                          "blocks are freed (default 600; 0: no limit)")
    srv.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                     help="largest request body accepted; larger ones get 413 before they are read (default 4 MiB)")
    srv.add_argument("--enable-weight-updates", action="store_true",
                     help="turn on POST /v1/weights/update (from a checkpoint path or a trainer's torch.distributed "
                          "group), /v1/weights/init_group, /sleep and /wake_up, for training loops; with --api-key "
                          "they take that key only (default: off, 404)")
    srv.add_argument("--enable-lora-updates", action="store_true",
                     help="turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's); with --api-key "
                          "they take that key only (default: off, 404)")
    srv.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                     help="run the engine core (scheduler, model, sampling, detokenization) in a process of its own "
                          "beside the HTTP server's, over ZeroMQ, so neither waits on the other's Python (vLLM V1's "
                          "shape). Default: on, except with --enable-weight-updates, --enable-lora-updates or "
                          "data-parallel replicas, which keep it in a thread of the server's process "
                          "(--no-engine-process: always there)")
    srv.add_argument("--shutdown-grace", type=float, default=2.0,
                     help="on SIGTERM, seconds open requests get to finish before they end with an error (default 2)")
    dp = srv.add_argument_group("data parallel (replicas on Ray)")
    dp.add_argument("--data-parallel-size", type=int, default=1,
                    help="engine replicas, each a Ray actor with the whole model, behind this one endpoint and a "
                         "router (default 1: no Ray)")
    dp.add_argument("--ray-address", default=None,
                    help="join this Ray cluster (e.g. auto, or ray://host:10001), which is how replicas span "
                         "machines; default: start a local one")
    dp.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "least_loaded", "round_robin"],
                    help="which replica a request goes to: cache_aware = the one whose past requests share the "
                         "longest prefix with it (the least loaded when load is imbalanced); least_loaded; "
                         "round_robin. Calls of a session always go to its replica (default cache_aware)")
    dp.add_argument("--replica-cpus", type=int, default=None,
                    help="Ray CPUs (and torch threads) per replica (default: this machine's cores / replicas)")
    dp.add_argument("--router-cache-threshold", type=float, default=0.3,
                    help="cache_aware: the share of a request's text a replica must have seen to win it (default 0.3)")
    dp.add_argument("--router-balance-abs", type=int, default=64,
                    help="cache_aware: route by load once the busiest replica has this many requests more than the "
                         "idlest ... (default 64)")
    dp.add_argument("--router-balance-rel", type=float, default=1.5,
                    help="... and this many times as many (default 1.5)")
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from sluice.bench.agents import add_parser as add_bench_agents
    from sluice.bench.serve import add_parser as add_bench_serve
    from sluice.bench.soak import add_parser as add_bench_soak
    add_bench_serve(bench_sub)
    add_bench_soak(bench_sub)
    add_bench_agents(bench_sub)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                     help="send the prompt as raw text instead of as a user chat message")
    add_engine_args(gen)
    add_sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive chat, streaming tokens as they come")
    chat.add_argument("--system", default=None, help="system prompt")
    add_engine_args(chat)
    add_sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
