"""The CUDA backend: bf16 / fp16 weights through torch's matmuls (cuBLAS) or, at the few
rows where it measured faster on this GPU, a split-K GEMV in Triton (gemv.py); FP8 weights
(--quantization fp8: fp8.py) through torch._scaled_mm and the same GEMV; paged attention
and RoPE with the K/V write in Triton (attention.py) over a bf16 or FP8 KV cache
(kv_fp8.py), RMSNorm (+ residual) and SwiGLU in Triton (ops.py), sampling on the GPU with
one host sync a step (the runner's), the KV cache sized from the GPU's free memory, and
CUDA graphs for decode-only steps (graphs.py).

Its plan line, e.g.:
    backend: cuda dtype=bfloat16 linear=fp8(scaled_mm+gemv) attention=triton-varlen+splitk kv=fp8
             norm=triton rope=triton head=cublas graphs=1,2,4,...,256 deterministic=off

What it does not run is refused in one line before anything loads: the CPU's quantization
schemes and int8 KV cache (their kernels are the CPU's), deterministic mode (its
batch-invariant kernels are the CPU's) and tensor parallelism (its ranks talk gloo).

Without a GPU the same backend runs on CPU tensors under Triton's interpreter
(TRITON_INTERPRET=1, Triton's own switch): that is how the suite drives the engine through
these kernels in CI. Graphs are then off.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch

from sluice import quantization as quant
from sluice.backends.base import AttentionMetadata, Backend, FlatBatch
from sluice.backends.kv_fp8 import FP8_ROW_EXTRA
from sluice.backends.torch_ref import TorchOps

logger = logging.getLogger("sluice.backends.select")

# A decode-only step splits each request's keys into ranges of at least this many tokens
# once its longest context passes it (split-K): below it, one program per (request, KV
# head) reads the whole context (attention.decode_attention).
SPLIT_K_MIN_TOKENS = 1024
# The most splits a decode step uses (the merge reads them all).
MAX_SPLITS = 16


# Keys an attention program scores per loop step under the interpreter, 16 on a GPU: the
# interpreter's cost is per op whatever a tile's size, so the engine's steps there take a
# 60-token context in one step, not four (the CUDA engine tests: 82 -> 69 s on a Zen 3).
# The kernel tests (tests/unit/test_triton_kernels.py) run the GPU's tile, several blocks
# to a tile and a block past a tile included.
INTERPRETER_KEY_TILE = 64


def interpreted() -> bool:
    """Triton's kernels run under its interpreter, on CPU tensors (its own switch)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class CudaAttentionPlan:
    """The CUDA attention's part of a step's record: its tiles (device tensors), or the
    split-K decode's plan."""
    decode_req: torch.Tensor | None      # tiles of one query token (decodes)
    decode_q0: torch.Tensor | None
    chunk_req: torch.Tensor | None       # tiles of `block_q` tokens of a prompt chunk (or drafts)
    chunk_q0: torch.Tensor | None
    block_q: int
    splits: int = 0                      # > 0: a decode-only step through split-K
    split_len: int = 0
    decode_only: bool = False            # every request computes one token (a graph can run it)
    key_tile: int = 16                   # keys a program scores per loop step (INTERPRETER_KEY_TILE)


class TritonOps(TorchOps):
    """The layer ops on Triton's kernels; torch's where a shape is off their path (Qwen3's
    per-head norms before RoPE, a head_dim that is not a power of two)."""
    name = "triton"

    def rms_norm(self, x, weight, eps):
        if weight.dtype != x.dtype:  # float32 weights (Gemma's 1 + w): torch's single rounding
            return super().rms_norm(x, weight, eps)
        from sluice.backends.cuda import ops
        return ops.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        if weight.dtype != x.dtype:
            return super().add_rms_norm(x, residual, weight, eps)
        from sluice.backends.cuda import ops
        return ops.add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up):
        from sluice.backends.cuda import ops
        return ops.silu_and_mul(gate_up)

    def rope_write_kv(self, qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim, q_norm=None,
                      k_norm=None):
        if q_norm is not None or head_dim & (head_dim - 1):
            return super().rope_write_kv(qkv, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads, head_dim,
                                         q_norm, k_norm)
        from sluice.backends.cuda import attention
        return attention.rope_write_kv(qkv, cos, sin, kv_cache[0], kv_cache[1], slot_mapping, num_heads,
                                       num_kv_heads, head_dim)

    def attention(self, q, k_cache, v_cache, meta: AttentionMetadata, scale, window=0):
        from sluice.backends.cuda import attention
        plan: CudaAttentionPlan = meta.extra
        tile = plan.key_tile
        if plan.splits:
            n = meta.seq_lens.shape[0]
            out = torch.zeros_like(q)
            attention.decode_attention(q[:n], k_cache, v_cache, meta.block_tables, meta.seq_lens, plan.splits,
                                       plan.split_len, scale, out=out[:n], window=window, key_tile=tile)
            return out
        out = torch.zeros_like(q)
        if plan.decode_req is not None:
            attention.varlen_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       plan.decode_req, plan.decode_q0, 1, scale, out=out, window=window,
                                       key_tile=tile)
        if plan.chunk_req is not None:
            attention.varlen_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       plan.chunk_req, plan.chunk_q0, plan.block_q, scale, out=out, window=window,
                                       key_tile=tile)
        return out


TRITON_OPS = TritonOps()


@dataclass
class CudaBackend(Backend):
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: str
    deterministic: bool
    tensor_parallel_size: int
    # CUDA graphs for decode-only steps (off: --enforce-eager, and under the interpreter).
    graphs_enabled: bool = True
    # The fraction of the GPU's memory the engine may hold (weights, activations, KV cache).
    gpu_memory_utilization: float = 0.9
    # Query heads per KV head (prepare() reads it off the model): an attention tile's rows
    # per query token.
    group: int = field(default=1, init=False)
    # The quantization scheme's name (None: the weights as loaded).
    quantization: str | None = None
    # The decode graphs (capture()) and their batch sizes, for the plan line.
    _graphs: object = field(default=None, init=False, repr=False)
    _graph_sizes: list = field(default_factory=list, init=False, repr=False)
    # bf16 layers that run the GEMV at some row counts (the calibration's choice).
    _gemv_layers: int = field(default=0, init=False, repr=False)
    # Keys an attention program scores per loop step: the GPU's 16, or the interpreter's
    # (INTERPRETER_KEY_TILE), decided once.
    key_tile: int = field(default_factory=lambda: INTERPRETER_KEY_TILE if interpreted() else 16, init=False)

    family = "cuda"
    # A GPU runs a 2,048-token step in one go.
    default_max_num_batched_tokens = 2048
    # The host plans step N + 1 and reads step N - 1's tokens while the GPU runs step N.
    overlap_pays = True
    # One block table for every layer: the graphs record one step record (a windowed layer
    # masks its keys but keeps its blocks); sliding-window groups are the CPU backend's.
    hybrid_kv = False
    ops = TRITON_OPS

    # -- chosen before anything loads ----------------------------------------------
    @classmethod
    def auto_quantization(cls, model_config, tensor_parallel_size: int) -> str | None:
        """A checkpoint that carries FP8 weights runs them as they are (quantization='fp8')."""
        from sluice.models.loader import checkpoint_is_fp8, resolve_model
        try:
            return "fp8" if checkpoint_is_fp8(resolve_model(model_config.model)) else None
        except ValueError:
            return None  # an unknown model: the loader says so

    @classmethod
    def auto_dtype_for(cls, device: str, cpu_isa: str = "auto") -> torch.dtype:
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return torch.float16
        return torch.bfloat16

    @classmethod
    def check_settings(cls, model_config, cache_config, tensor_parallel_size: int) -> None:
        m = model_config
        scheme = quant.get(m.quantization)
        if scheme is not None and cls.family not in scheme.families:
            ok = "".join(f"quantization={s.name!r} or " for s in quant.SCHEMES.values() if cls.family in s.families)
            raise ValueError(f"quantization={m.quantization!r} runs on sluice's CPU kernels; on device={m.device!r} "
                             f"what works: {ok}None (bf16 or fp16 weights through cuBLAS)")
        if cache_config.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype={cache_config.kv_cache_dtype!r} runs on sluice's CPU kernels; on "
                             f"device={m.device!r} what works: kv_cache_dtype='fp8' (the same saving) or 'auto'")
        if m.deterministic:
            raise ValueError(f"deterministic mode runs on the CPU (its batch-invariant kernels have no CUDA build "
                             f"yet); on device={m.device!r} what works: the default (non-deterministic) mode")
        if tensor_parallel_size > 1:
            raise ValueError(f"tensor_parallel_size > 1 runs on the CPU (gloo between rank processes); on "
                             f"device={m.device!r} ranks over NCCL are not built yet: what works is "
                             f"tensor_parallel_size=1")

    @classmethod
    def build(cls, model_config, cache_config, dtype, tensor_parallel_size: int = 1) -> "CudaBackend":
        cls.check_settings(model_config, cache_config, tensor_parallel_size)
        device = torch.device(model_config.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={model_config.device!r}: torch sees no CUDA device here "
                             f"(torch {torch.__version__}); what works here: device='cpu'")
        if device.type != "cuda" and not interpreted():
            raise ValueError(f"the CUDA backend runs its Triton kernels on a GPU, or on CPU tensors only under "
                             f"Triton's interpreter (TRITON_INTERPRET=1); device={model_config.device!r}")
        try:
            import triton  # noqa: F401
        except ImportError as e:
            raise ValueError(f"device={model_config.device!r} needs triton ({e}); pip install triton") from e
        fp8 = [mode for mode, on in (("quantization='fp8'", model_config.quantization == "fp8"),
                                     ("kv_cache_dtype='fp8'", cache_config.kv_cache_dtype == "fp8")) if on]
        if fp8 and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(f"{' and '.join(fp8)} need FP8 arithmetic (compute capability 8.9+: Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is sm_{major}{minor}: what works there is bf16 "
                             f"(quantization=None, kv_cache_dtype='auto')")
        dtype = cls.auto_dtype_for(model_config.device) if dtype is None else dtype
        graphs = device.type == "cuda" and not model_config.enforce_eager
        return cls(device=device, dtype=dtype, kv_cache_dtype=cache_config.kv_cache_dtype, deterministic=False,
                   tensor_parallel_size=tensor_parallel_size, graphs_enabled=graphs,
                   gpu_memory_utilization=cache_config.gpu_memory_utilization, quantization=model_config.quantization)

    def line(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        graphs = ("off" if not self.graphs_enabled else ",".join(map(str, self._graph_sizes)) if self._graph_sizes
                  else "on")
        kv = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        return (f"backend: {self.device.type} dtype={dtype} linear={self._linear_name()} "
                f"attention=triton-varlen+splitk kv={kv} norm=triton rope=triton head=cublas graphs={graphs} "
                f"deterministic=off")

    def _linear_name(self) -> str:
        """cublas, with +gemv where the GEMV runs some row counts; fp8(scaled_mm+gemv)."""
        if self.quantization == "fp8":
            return "fp8(scaled_mm+gemv)"
        return "cublas+gemv" if self._gemv_layers else "cublas"

    # -- the model --------------------------------------------------------------
    def check_model(self, arch) -> None:
        if self.kv_cache_dtype == "fp8" and arch.head_dim % 4:
            raise ValueError(f"kv_cache_dtype='fp8' takes head_dim a multiple of 4 (each row's float32 scale "
                             f"stays aligned), this model has {arch.head_dim}")

    @torch.no_grad()
    def prepare(self, model, quantization=None, max_positions=None, with_head: bool = True) -> None:
        """Quantize to FP8 if asked (the layers keep only their FP8 form), measure where the
        GEMV beats cuBLAS on this GPU (not under the interpreter: there the FP8 layers run
        it up to GEMV_MAX_ROWS rows and bf16 layers keep F.linear), set the layer ops."""
        from sluice.backends.cuda.fp8 import Fp8Linear
        from sluice.backends.cuda.gemv import GEMV_MAX_ROWS
        from sluice.quantization.fp8 import fp8_layers
        # Query heads per KV head: the rows of one attention tile per query token.
        self.group = model.arch.num_heads // model.arch.num_kv_heads
        scheme = quant.get(quantization)
        layers = fp8_layers(model)
        measure = self.device.type == "cuda" and not interpreted()
        choices: dict = {}
        for name, module in layers:
            if scheme is not None:
                scheme.quantize_rows(module)
                scheme.release(module)
                module.method = Fp8Linear(module.fp8_weight, module.fp8_scale, None, GEMV_MAX_ROWS)
            if measure:
                choice = self._calibrated(module, choices)
                if scheme is not None:
                    module.method.gemv_choice = choice
                elif choice.configs:
                    from sluice.backends.cuda.fp8 import GemvLinear
                    module.method = GemvLinear(module.weight, choice)
                    self._gemv_layers += 1
        if measure:
            self._log_gemv(choices)
        for module in model.modules():
            if hasattr(type(module), "ops"):
                module.ops = self.ops
        if with_head:
            model.head = model.lm_head

    def _calibrated(self, module, choices: dict):
        """The GEMV's measured choice for this layer's shape (one measurement a shape); where
        the measurement itself fails, no GEMV for the shape (cuBLAS is always right)."""
        from sluice.backends.cuda.gemv import GemvChoice
        fp8 = getattr(module, "fp8_weight", None) is not None
        weight = module.fp8_weight if fp8 else module.weight
        key = (tuple(weight.shape), fp8)
        if key not in choices:
            try:
                choices[key] = self._measure(module, weight, fp8)
            except Exception as e:
                logger.warning("GEMV calibration on %s %s failed (%s: %s); cuBLAS runs it", tuple(weight.shape),
                               "fp8" if fp8 else "bf16", type(e).__name__, e)
                choices[key] = GemvChoice({}, {})
        return choices[key]

    def _measure(self, module, weight, fp8: bool):
        """The GEMV against what the layer runs otherwise: cuBLAS, or for FP8 its
        _scaled_mm path (the GEMV turned off while it is timed)."""
        from sluice.backends.cuda.gemv import calibrate
        if not fp8:
            return calibrate(weight, None, lambda x: torch.nn.functional.linear(x, weight), self.dtype)
        method = module.method
        saved, method.gemv_max_rows = method.gemv_max_rows, 0
        try:
            return calibrate(weight, module.fp8_scale, method, self.dtype)
        finally:
            method.gemv_max_rows = saved

    @staticmethod
    def _log_gemv(choices: dict) -> None:
        for (shape, fp8), choice in choices.items():
            parts = [f"{rows}: {'gemv ' + choice.configs[rows].describe() if rows in choice.configs else 'cublas'} "
                     f"{t_g:.1f} vs {t_o:.1f} us" for rows, (t_g, t_o) in sorted(choice.times.items())]
            logger.info("GEMV %s %dx%d, rows %s", "fp8" if fp8 else "bf16", shape[0], shape[1], "; ".join(parts))

    def update(self, model, quantization, written, with_head: bool = True) -> None:
        """Weights are used in place (bf16 layers as loaded; FP8 layers' new rows were
        quantized by their write_rows as they were written): nothing to rebuild but the
        graphs, which read the tensors in place and so see the new values."""

    # -- the KV cache -------------------------------------------------------------
    def kv_row_bytes(self, arch) -> int:
        if self.kv_cache_dtype == "fp8":
            return arch.head_dim + FP8_ROW_EXTRA
        return super().kv_row_bytes(arch)

    def allocate_kv_cache(self, num_layers, num_kv_heads, num_blocks, block_size, head_dim):
        """bf16 (the model's dtype) as every backend, or the FP8 layout (kv_fp8.py):
        [kv_heads, num_blocks + 1, block_size, head_dim + 4] e4m3 bytes, each block's first
        4 x block_size bytes its tokens' float32 scales."""
        if self.kv_cache_dtype != "fp8":
            return super().allocate_kv_cache(num_layers, num_kv_heads, num_blocks, block_size, head_dim)
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim + FP8_ROW_EXTRA)
        return [(torch.zeros(shape, dtype=torch.float8_e4m3fn, device=self.device),
                 torch.zeros(shape, dtype=torch.float8_e4m3fn, device=self.device)) for _ in range(num_layers)]

    def num_kv_blocks(self, cache, arch, num_kv_heads=None) -> int:
        """As many blocks as `gpu_memory_utilization` of the GPU leaves once the weights
        (already loaded) and a step's activations are in: --kv-cache-memory's role on a CPU."""
        if cache.num_blocks or self.device.type != "cuda":
            return super().num_kv_blocks(cache, arch, num_kv_heads)
        per_block = self.kv_bytes_per_block(arch, cache.block_size, num_kv_heads)
        free, total = torch.cuda.mem_get_info(self.device)
        # Activations of the largest step: a few [tokens, intermediate] buffers and the logits.
        reserve = 8 * self.default_max_num_batched_tokens * max(arch.intermediate_size, arch.hidden_size) * 4 \
            + 2 * 256 * arch.vocab_size * 4
        room = int(total * self.gpu_memory_utilization) - (total - free) - reserve
        blocks = room // per_block
        if blocks < 1:
            raise ValueError(f"the model does not fit: with gpu_memory_utilization={self.gpu_memory_utilization} of "
                             f"{total / 2**30:.1f} GiB, {(total - free) / 2**30:.1f} GiB in use (weights) leaves no "
                             f"room for one KV block ({per_block / 2**20:.1f} MiB); raise gpu_memory_utilization or "
                             f"use a smaller model")
        return blocks

    # -- one step -----------------------------------------------------------------
    def to_device(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """Built in pinned host memory and copied without blocking the host (the copy is
        queued on the stream before the step's kernels that read it)."""
        if self.device.type != "cuda":
            return torch.tensor(data, dtype=dtype, device=self.device)
        return torch.tensor(data, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def attention_metadata(self, batch: FlatBatch) -> AttentionMetadata:
        from sluice.backends.cuda.attention import block_q_for, varlen_tiles
        qs, seq_lens = batch.query_start, batch.seq_lens
        n = len(seq_lens)
        max_blocks = max(len(b) for b in batch.block_ids)

        def to_dev(data, dtype=torch.int32):
            return self.to_device(data, dtype)

        q_lens = [qs[i + 1] - qs[i] for i in range(n)]
        longest = max(seq_lens)
        plan = CudaAttentionPlan(None, None, None, None, 1, decode_only=max(q_lens) == 1, key_tile=self.key_tile)
        if plan.decode_only and longest > SPLIT_K_MIN_TOKENS:
            plan.splits = min(MAX_SPLITS, -(-longest // SPLIT_K_MIN_TOKENS))
            plan.split_len = -(-longest // plan.splits)
        else:
            dec = [i for i in range(n) if q_lens[i] == 1]
            chunks = [i for i in range(n) if q_lens[i] > 1]
            if dec:
                plan.decode_req, plan.decode_q0 = to_dev(dec), to_dev([0] * len(dec))
            if chunks:
                plan.block_q = block_q_for(self.group, max(q_lens[i] for i in chunks))
                reqs, q0s = varlen_tiles(qs, plan.block_q, chunks)
                plan.chunk_req, plan.chunk_q0 = to_dev(reqs), to_dev(q0s)
        return AttentionMetadata(
            slot_mapping=to_dev(batch.slots, torch.long),
            query_start_loc=to_dev(qs),
            seq_lens=to_dev(seq_lens),
            block_tables=to_dev([b + [0] * (max_blocks - len(b)) for b in batch.block_ids]),
            extra=plan,
        )

    # -- CUDA graphs -----------------------------------------------------------------
    def capture(self, runner) -> None:
        """Record the decode-only forward pass at every padded batch size (graphs.py); on a
        failure, say why and run every step eagerly."""
        self._graphs = None
        if not self.graphs_enabled:
            return
        from sluice.backends.cuda.graphs import DecodeGraphs
        max_len = runner.max_model_len
        splits = min(MAX_SPLITS, max(1, -(-max_len // SPLIT_K_MIN_TOKENS)))
        graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.max_num_seqs, max_len, runner.block_size,
                              runner.scratch_slot, splits, self.device)
        try:
            graphs.capture()
        except Exception as e:  # a model or shape the capture cannot take: eager is always right
            logger.warning("CUDA graph capture failed (%s: %s); every step runs eagerly", type(e).__name__, e)
            return
        self._graphs = graphs
        self._graph_sizes = sorted(graphs.graphs)

    def release(self) -> None:
        """Drop the graphs (the KV tensors they read are being freed)."""
        self._graphs = None

    def forward(self, model, input_ids, positions, meta: AttentionMetadata, kv_caches):
        # A step with LoRA rows runs eagerly: the graphs hold no adapter's work.
        if self._graphs is not None and meta.extra.decode_only and getattr(model, "lora_step", None) is None:
            out = self._graphs.run(input_ids, positions, meta)
            if out is not None:
                return out
        return model(input_ids, positions, meta, kv_caches)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
