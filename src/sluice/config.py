"""Typed engine configuration: model, cache and scheduler settings.

Built from keyword arguments (offline API) or CLI flags; no environment variables.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from sluice import quantization

DEFAULT_MODEL = "smollm2-135m"

# None: full precision; else a scheme's name (quantization/: int8, w8a8, w4a8); "auto":
# the checkpoint's own quantized form where a kernel here computes it (the backend's pick).
QUANTIZATIONS = (None, "auto", *quantization.NAMES)
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
KV_OFFLOAD_DTYPES = ("auto", "exact", "int8")
LOAD_FORMATS = ("auto", "dummy")


@dataclass
class ModelConfig:
    model: str = DEFAULT_MODEL
    # "auto": what the device's backend computes fastest (backends/select.py), or a name.
    dtype: str = "auto"
    # "auto": cuda where torch sees a GPU, else cpu (backends/select.py); or a torch device.
    device: str = "auto"
    # None: the model's own context length.
    max_model_len: int | None = None
    seed: int = 0
    # None, or a quantization scheme by name (quantization/: "int8" weight-only int8;
    # "w8a8" the same int8 weights times int8 activations per block of 32; "w4a8" 4-bit
    # weights in llama.cpp's Q4_1 form times the same int8 activations), or "auto": a GGUF's
    # quantized weights run in their own form where a kernel of this machine holds them
    # exactly (a Q4_1 file in bfloat16 on the CPU kernels: w4a8), else None. Resolved by
    # EngineConfig.validate (backends/select.py check_config).
    quantization: str | None = "auto"
    # Whether quantization was the "auto" choice (a backend that cannot build its kernels
    # then runs in full precision instead of refusing).
    quantization_auto: bool = field(default=False, init=False, repr=False)
    # Batch-invariant kernels: a request's tokens and logprobs are bitwise the same
    # whatever shares its batch (docs/determinism.md).
    deterministic: bool = False
    # CUDA: every step eager, no CUDA graphs for decode steps.
    enforce_eager: bool = False
    # "auto": the checkpoint's weights; "dummy": random weights of the model's shape, made
    # on the device from its config alone (to measure speed; vLLM's --load-format dummy).
    load_format: str = "auto"
    # Which build of sluice's CPU kernels runs: "auto" (the best this CPU executes),
    # "avx512", "avx512_vnni", "avx2_vnni" or "avx2" (force a lower build, e.g. to test it on an AVX-512
    # machine) or "generic" (none: torch's own ops). backends/platform.py.
    cpu_isa: str = "auto"


@dataclass
class CacheConfig:
    block_size: int = 16
    # GiB of memory for K and V of all layers; ignored when num_blocks is given. (CUDA sizes
    # the cache from gpu_memory_utilization instead.)
    kv_cache_memory: float = 1.0
    # CUDA: the fraction of the GPU's memory the engine may use (weights, activations, KV).
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    # "auto": K and V in the model's dtype. "int8": one int8 value per element and one
    # float32 scale per token and kv head (53% of a bf16 cache's bytes, so ~1.9x the
    # tokens in the same memory and less to read per decode step); CPU, bfloat16, with
    # our kernels (AVX-512 VNNI). Block sizes a multiple of 16. "fp8": e4m3 values with a
    # float32 scale per token and kv head, the same saving on CUDA (backends/kv_fp8.py).
    kv_cache_dtype: str = "auto"
    # KV offloading (core/kv_offload.py): GiB of host memory for blocks the pool evicts
    # (prefix-cache and session blocks), copied back on a later hit instead of recomputed;
    # 0: off. Under it, optionally a disk tier of kv_offload_disk_size GiB in a file in
    # kv_offload_dir.
    kv_offload_memory: float = 0.0
    kv_offload_dir: str | None = None
    kv_offload_disk_size: float = 4.0
    # The offloaded blocks' form (worker/kv_offload_store.py): "exact" the cache's own
    # bytes; "int8" a bf16/float16/float32 cache compressed per row (~1.9x the blocks per
    # GiB for bf16, not bit-exact); "auto": int8 for a bf16 or float16 cache outside
    # deterministic mode, else exact.
    kv_offload_dtype: str = "auto"


SCHEDULING_POLICIES = ("auto", "fcfs", "priority", "program", "fair")


def parse_name_weights(items: list[str], flag: str, what: str = "WEIGHT") -> dict[str, float]:
    """Repeated NAME=NUMBER flags (--tenant-weight, bench agents' --tenant) as a dict;
    ValueError naming the flag and the bad item."""
    out = {}
    for item in items:
        name, sep, weight = item.rpartition("=")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not sep or not name or value is None or not value > 0:
            raise ValueError(f"{flag} takes NAME={what} with a {what.lower()} > 0, got {item!r}")
        out[name] = value
    return out


@dataclass
class SchedulerConfig:
    # None: the device's default (its backend's default_max_num_batched_tokens: 256 on a
    # CPU, where a 2,048-token step takes over a second and every prompt in it waits for
    # all of it; 2,048 on a GPU, which runs it in one go).
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    # Who is admitted (and preempted) first: auto (program while calls with a session are
    # queued or running, else fcfs), fcfs, priority, program or fair (see
    # core/scheduler.py's docstring).
    policy: str = "auto"
    # `program`: a call waiting this long goes ahead of every call that has not.
    starvation_s: float = 30.0
    # Sessions (core/sessions.py): a call's blocks stay pinned this long after it ends
    # until the session has shown the gaps between its calls (then the TTL follows them),
    # at most session_ttl_max_s; 0 pins nothing. Pins take at most max_pinned_fraction of
    # the KV cache; at most max_sessions are remembered (the longest idle dropped).
    session_ttl_s: float = 30.0
    session_ttl_max_s: float = 300.0
    max_pinned_fraction: float = 0.5
    max_sessions: int = 10000
    # `fair`: tenant name -> weight (default 1): a tenant of weight 2 gets twice the
    # token service of a tenant of weight 1 when both are backlogged.
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # A step-time (so TPOT) target in ms: each step's token budget is sized from measured
    # step times to hold it (core/latency_target.py); None: the fixed budget.
    target_tpot_ms: float | None = None
    # A bound on how long a stream stays out of the batch after a preemption: a preempted
    # request that has streamed tokens is resumed ahead of new work, and once its last token
    # is this many seconds old, running requests give way to it (core/scheduler.py,
    # "Stalls"); None: it waits for room like any other request.
    max_stream_stall_s: float | None = None
    # Plan step N + 1 and turn step N - 1's tokens into output while step N runs
    # (LLMEngine's overlap loop; vLLM's async scheduling, SGLang's overlap scheduler).
    # None: where the device's backend says it pays (a GPU: yes; a CPU: no).
    async_scheduling: bool | None = None


@dataclass
class StructuredOutputsConfig:
    # Compiled grammars kept for reuse (least recently used dropped past it).
    grammar_cache_size: int = 64
    # A grammar still compiling after this many seconds is refused (the server's 400).
    grammar_compile_timeout_s: float = 10.0
    # A thinking model's format (sluice/reasoning.py FORMATS: "qwen3", "deepseek_r1"): its
    # reasoning is split from the answer, and grammars apply to the answer only. None: off.
    reasoning_parser: str | None = None


SPECULATIVE_METHODS = (None, "ngram", "suffix")
SPECULATIVE_GATES = ("auto", "always")
MAX_SPECULATIVE_TOKENS = 16


@dataclass
class SpeculativeConfig:
    # Drafts without a second model (spec/proposers.py): ngram = prompt lookup in the
    # request's own prompt and output; suffix = that and the recent outputs of its tenant;
    # None: off. On by default: the gate runs it only where it pays (docs/benchmarks.md,
    # "Speculative decoding": c1 2.9-3.1x faster, c32 no slower).
    speculative_method: str | None = "ngram"
    # Drafted tokens per request and step, at most (each verified in the same forward pass).
    num_speculative_tokens: int = 8
    # auto: speculate in a step only where the measured step times say it pays
    # (spec/gate.py); always: every step a draft is found (for measuring).
    speculative_gate: str = "auto"
    # The shortest match of the context's last tokens that yields a draft.
    speculative_min_match: int = 2
    # suffix: each tenant's recent outputs kept for drafting, in tokens.
    suffix_cache_tokens: int = 16384


@dataclass
class ParallelConfig:
    # Ranks (processes) the model is split over, each with its KV-head group of attention
    # and its slice of the MLP (distributed/parallel.py); gloo all-reduces between them.
    tensor_parallel_size: int = 1


@dataclass
class LoRAConfig:
    # Serve LoRA adapters (lora/): on with any lora_modules; on without them for adapters
    # loaded at run time (the server's /v1/load_lora_adapter).
    enable_lora: bool = False
    # Adapters loaded at start: name -> PEFT folder (a request picks one by `model`).
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Adapters resident at once (each in a slot of every adapted layer): also the most
    # distinct adapters one step runs; the others wait in host memory.
    max_loras: int = 4
    # The largest adapter rank taken.
    max_lora_rank: int = 64

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    structured: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Flat keyword arguments (model=, dtype=, block_size=, ...) to nested config."""
        parts = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "structured": StructuredOutputsConfig, "speculative": SpeculativeConfig, "parallel": ParallelConfig,
                 "lora": LoRAConfig}
        values: dict[str, dict] = {name: {} for name in parts}
        for key, value in kwargs.items():
            for name, klass in parts.items():
                if key in {f.name for f in dataclasses.fields(klass) if f.init}:
                    values[name][key] = value
                    break
            else:
                raise ValueError(f"unknown engine option {key!r}")
        cfg = cls(**{name: parts[name](**v) for name, v in values.items()})
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Every cross-field check, once, before anything loads: the values here, then what
        the device's backend can run (backends/select.py check_config, which also fills in
        the device's defaults)."""
        from sluice.backends.select import check_config
        c, s = self.cache, self.scheduler
        if c.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {c.block_size}")
        if c.num_blocks is not None and c.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {c.num_blocks}")
        if c.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {c.kv_cache_memory}")
        if not 0 < c.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {c.gpu_memory_utilization}")
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {s.max_num_batched_tokens}")
        if s.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {s.max_num_seqs}")
        if s.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {', '.join(SCHEDULING_POLICIES)}; got {s.policy!r}")
        if not s.starvation_s > 0:
            raise ValueError(f"starvation_s must be > 0 seconds, got {s.starvation_s}")
        if not 0 <= s.session_ttl_s <= s.session_ttl_max_s:
            raise ValueError(f"session_ttl_s must be in [0, session_ttl_max_s={s.session_ttl_max_s}], "
                             f"got {s.session_ttl_s}")
        if not 0 <= s.max_pinned_fraction <= 1:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {s.max_pinned_fraction}")
        if s.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {s.max_sessions}")
        if s.max_stream_stall_s is not None and not s.max_stream_stall_s > 0:
            raise ValueError(f"max_stream_stall_s must be > 0 seconds, got {s.max_stream_stall_s}")
        if s.target_tpot_ms is not None and not s.target_tpot_ms > 0:
            raise ValueError(f"target_tpot_ms must be > 0 ms, got {s.target_tpot_ms}")
        g = self.structured
        if isinstance(g.grammar_cache_size, bool) or not isinstance(g.grammar_cache_size, int) \
                or g.grammar_cache_size < 1:
            raise ValueError(f"grammar_cache_size must be an integer >= 1, got {g.grammar_cache_size!r}")
        if not g.grammar_compile_timeout_s > 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0 seconds, got {g.grammar_compile_timeout_s}")
        from sluice.reasoning import FORMATS
        if g.reasoning_parser is not None and g.reasoning_parser not in FORMATS:
            raise ValueError(f"unknown reasoning_parser {g.reasoning_parser!r}; supported: {', '.join(FORMATS)}")
        tp = self.parallel.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
        for name, w in s.tenant_weights.items():
            if not isinstance(name, str) or isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
                raise ValueError(f"tenant_weights must map tenant names to weights > 0; got {name!r}: {w!r}")
        if c.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {c.kv_cache_dtype!r}")
        if c.kv_cache_dtype == "int8" and c.block_size % 16:
            raise ValueError(f"kv_cache_dtype='int8' takes block_size a multiple of 16, got {c.block_size}")
        if not c.kv_offload_memory >= 0:
            raise ValueError(f"kv_offload_memory must be >= 0 GiB, got {c.kv_offload_memory}")
        if c.kv_offload_dtype not in KV_OFFLOAD_DTYPES:
            raise ValueError(f"kv_offload_dtype must be one of {', '.join(KV_OFFLOAD_DTYPES)}; "
                             f"got {c.kv_offload_dtype!r}")
        if c.kv_offload_dir is not None:
            if not c.kv_offload_memory > 0:
                raise ValueError("kv_offload_dir needs kv_offload_memory > 0: the disk tier takes what the host tier "
                                 "lets go")
            if not c.kv_offload_disk_size > 0:
                raise ValueError(f"kv_offload_disk_size must be > 0 GiB, got {c.kv_offload_disk_size}")
        if c.kv_offload_memory > 0:
            if c.kv_offload_dtype == "int8" and self.model.deterministic:
                raise ValueError("kv_offload_dtype='int8' changes a reloaded block's bits, which deterministic mode "
                                 "promises to keep: use 'exact' (or 'auto')")
            if c.kv_offload_dtype == "int8" and c.kv_cache_dtype != "auto":
                raise ValueError(f"kv_offload_dtype='int8' compresses a bf16/float16/float32 cache; an "
                                 f"{c.kv_cache_dtype} KV cache is offloaded as it is ('exact' or 'auto')")
            if self.parallel.tensor_parallel_size > 1:
                raise ValueError("KV offloading runs in one process: not with tensor_parallel_size > 1")
        if self.model.quantization != "auto":
            quantization.get(self.model.quantization)  # ValueError for an unknown scheme
        if self.model.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.model.load_format!r}")
        if self.model.max_model_len is not None and self.model.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.model.max_model_len}")
        lo = self.lora
        for name, value in (("max_loras", lo.max_loras), ("max_lora_rank", lo.max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(lo.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in lo.lora_modules.items()):
            raise ValueError(f"lora_modules must map adapter names to folders, got {lo.lora_modules!r}")
        if lo.enabled and tp > 1:
            raise ValueError("LoRA adapters run in one process: not with tensor_parallel_size > 1")
        # What the device cannot run, refused before any kernel is built or weight loaded;
        # and the device's defaults.
        check_config(self)
        self._validate_speculative()

    def _validate_speculative(self) -> None:
        sp = self.speculative
        if sp.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be None, 'ngram' or 'suffix'; got {sp.speculative_method!r}")
        k = sp.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if sp.speculative_gate not in SPECULATIVE_GATES:
            raise ValueError(f"speculative_gate must be one of {', '.join(SPECULATIVE_GATES)}; "
                             f"got {sp.speculative_gate!r}")
        budget = self.scheduler.max_num_batched_tokens
        if sp.speculative_method is not None and budget is not None and k >= budget:
            raise ValueError(f"num_speculative_tokens ({k}) must be below max_num_batched_tokens ({budget}): a "
                             f"request verifying k drafts puts k + 1 tokens in one step")
        m = sp.speculative_min_match
        if isinstance(m, bool) or not isinstance(m, int) or not 2 <= m <= 64:
            raise ValueError(f"speculative_min_match must be an integer in [2, 64], got {m!r}")
        t = sp.suffix_cache_tokens
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"suffix_cache_tokens must be an integer >= 0, got {t!r}")
