"""The CPU backend: which of our C++ kernels (backends/cpu/x86, one build per ISA) or
torch's own ops runs each op, decided once from the CPU's features (backends/platform.py),
the `cpu_isa` setting, the dtype, the quantization scheme, the KV-cache dtype and
deterministic mode, and logged as one plan line:

- the kernel build ("avx512", "avx512_vnni", "avx2_vnni", "avx2") or none ("generic": torch's ops);
- the linear method (LINEAR_METHODS; backends/cpu/linear.py implements them, the
  quantization schemes pack into them);
- attention for prompt chunks and decodes, per KV dtype (backends/cpu/ops.py);
- RMSNorm, SwiGLU, RoPE + cache write, and the LM head / greedy argmax;
- the decoder layers as one C++ call where the kernels run the model (DecoderStack).

A mode this CPU cannot run is refused in one line that says what is missing and what would
work (`check`), before any kernel is built or weight loaded. Adding an x86 ISA is one entry
in x86 VARIANTS and platform.ISA_NEEDS (and, if its intrinsics are not AVX-512's, a header
like avx2/avx512_on_avx2.h); an ARM build would be a folder beside x86/.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from sluice import quantization as quant
from sluice.backends.base import AttentionMetadata, Backend, FlatBatch, PrefillChunk
from sluice.backends.cpu.huge_pages import huge_zeros, to_huge_pages
from sluice.backends.cpu.linear import (KernelWeight, PackedRows, PackedWeight, kernel_weight, prepack_weight,
                                       release_packed_weight, restore_packed_weight)
from sluice.backends.cpu.ops import DecodeKernelOps, KernelOps
from sluice.backends.kv_int8 import INT8_ROW_EXTRA
from sluice.backends.torch_ref import TORCH_OPS
from sluice.heap import return_freed_memory
from sluice.models.linear import Linear
from sluice.quantization.base import weight_read_directly
from sluice.quantization.int8 import quantize_per_channel
from sluice.worker.shapes import bucket

logger = logging.getLogger("sluice.backends.select")

# Default token budget of one step. On a CPU a 2,048-token step takes over a second and
# every prompt in it waits for the whole step: 32 clients sending ~210-token prompts at
# once got a TTFT p50 of 3.4 s at 2,048, 1.25 s at 512 and 0.91 s at 256, at the same
# output tok/s; prompt throughput on 2,000-token prompts was no lower at 256 (measured,
# docs/benchmarks.md). It is not below the default max_num_seqs, so that every running
# request can decode in one step.
CPU_MAX_NUM_BATCHED_TOKENS = 256

# Linear layers' implementations by name: what each computes and with which weights.
LINEAR_METHODS = {
    "torch": "F.linear on the model-dtype weights",
    "onednn-bf16": "oneDNN on prepacked bf16 weights",
    "torch-int8": "int8 weights (per-channel scales): torch's int8 matmul up to 2 rows, the dequantized weights above",
    "torch-int8+onednn-bf16": "torch-int8, with the dequantized weights prepacked for oneDNN",
    "kernels": "sluice's kernels on the model-dtype weights, one reduction order per output (batch-invariant)",
    "kernels-int8": "sluice's kernels, int8 weights times bf16 activations (up to 8 rows; bf16 weights above)",
    "kernels-int8-invariant": "sluice's kernels, int8 weights times bf16 activations at every row count",
    "kernels-w8a8": "sluice's kernels, int8 weights times int8 activations per block of 32",
    "kernels-w4a8": "sluice's kernels, 4-bit weights (Q4_1's form) times int8 activations per block of 32",
    "kernels-gguf": "sluice's kernels, a GGUF's own quantized blocks (Q4/Q5/Q8, K-quants) times int8 activations "
                    "per block of 32, every layer and the LM head",
}

# Tokens per row that the greedy fast path rescores exactly (GreedyHead).
GREEDY_CANDIDATES = 16


def _modes(quantization, kv_cache_dtype, deterministic) -> list[tuple[str, str]]:
    """The modes that only sluice's kernels run, with what works instead."""
    out = []
    if deterministic:
        out.append(("deterministic mode", "the default (non-deterministic) mode"))
    scheme = quant.get(quantization)
    if scheme is not None and scheme.needs_kernels:
        torch_ok = "".join(f"quantization={s.name!r}, " for s in quant.SCHEMES.values()
                           if not s.needs_kernels and "cpu" in s.families)
        out.append((f"quantization={quantization!r}", f"{torch_ok}or none"))
    if kv_cache_dtype == "int8":
        out.append(("kv_cache_dtype='int8'", "kv_cache_dtype='auto'"))
    return out


def refuse_gpu_modes(quantization: str | None, kv_cache_dtype: str) -> None:
    """One-line ValueErrors for the modes only the CUDA backend runs (FP8), naming what
    the CPU runs instead."""
    scheme = quant.get(quantization)
    if scheme is not None and "cpu" not in scheme.families:
        cpu_ok = ", ".join(s.name for s in quant.SCHEMES.values() if "cpu" in s.families)
        raise ValueError(f"quantization={quantization!r} runs on CUDA ({' and '.join(scheme.families)}: FP8 tensor "
                         f"cores); on device='cpu' what works: quantization {cpu_ok} or none")
    if kv_cache_dtype == "fp8":
        raise ValueError("kv_cache_dtype='fp8' runs on CUDA (its Triton attention reads e4m3); on device='cpu' what "
                         "works: kv_cache_dtype='int8' (the same bytes a token, sluice's kernels) or 'auto'")


def check(cpu_isa: str, quantization: str | None, kv_cache_dtype: str, deterministic: bool) -> str:
    """The kernel variant this configuration runs ("generic" for none), or a one-line
    ValueError for what cannot run here; reads the CPU, builds nothing."""
    from sluice.backends.platform import cpu
    info = cpu()
    isa = info.resolve_isa(cpu_isa)
    if isa == "generic":
        for mode, instead in _modes(quantization, kv_cache_dtype, deterministic):
            why = ("cpu_isa='generic' runs torch's own ops" if cpu_isa == "generic"
                   else f"{info.describe()} has no AVX2")
            raise ValueError(f"{mode} needs sluice's C++ kernels (an AVX2 or AVX-512 CPU), and {why}; "
                             f"what works here: {instead}")
    return isa


def auto_dtype(isa: str) -> torch.dtype:
    """dtype='auto': bfloat16 wherever sluice's kernels run the model (they read bf16
    weights, half float32's bytes, and compute in float32: docs/design.md says what that
    costs in quality) or oneDNN computes bf16 natively; float32 elsewhere."""
    if isa != "generic":
        return torch.bfloat16
    from sluice.backends.platform import cpu
    return torch.bfloat16 if cpu().onednn_bf16 and "avx512_bf16" in cpu().flags else torch.float32


def model_dtype(model_config, kv_cache_dtype: str, isa: str, dtype: torch.dtype) -> torch.dtype:
    """`dtype` ('auto' resolved), or a one-line ValueError for a mode it cannot run here."""
    m = model_config
    if m.deterministic and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"deterministic mode supports float32 and bfloat16, not {dtype}")
    if (m.quantization is not None or kv_cache_dtype == "int8") and dtype != torch.bfloat16:
        got = f"dtype={str(dtype).removeprefix('torch.')} on {m.device!r}"
        if m.dtype == "auto":
            got += " (what dtype='auto' picks here; ask for dtype='bfloat16')"
        mode = f"quantization={m.quantization!r}" if m.quantization is not None else "kv_cache_dtype='int8'"
        raise ValueError(f"{mode} needs dtype bfloat16 on the CPU; got {got}")
    return dtype


@dataclass
class GreedyHead:
    """The argmax of the bf16 LM head per row, fast: an approximate head runs first and its
    GREEDY_CANDIDATES best tokens per row are rescored with the bf16 head's own arithmetic
    (the same bits); the best of those is the answer. The approximate head has per-row
    int8 weights times activations quantized per block of 32: to int8 (w8a8_linear, ~0.6x
    the bf16 head's time at 32 rows, ~0.3x at one), or on the plain AVX2 build to 7 bits
    (head_w8a7, without the sign trick: ~0.7x w8a8's time from 8 rows). That is the full
    head's argmax unless the approximation pushed the true best below GREEDY_CANDIDATES
    others: over ~8,000 greedy steps of the default model it ranked at most 2nd with
    either activations (docs/lab-notes.md, session 37)."""
    kernels: object
    packed_int8: torch.Tensor  # the head's int8 weights, packed for w8a8_linear or head_w8a7
    scale: torch.Tensor        # their per-row scales
    packed: torch.Tensor       # the bf16 head, packed for bi_linear
    vocab_size: int
    seven_bit: bool = False    # head_w8a7 rather than w8a8_linear

    def __call__(self, hidden: torch.Tensor, grammar=None) -> torch.Tensor:
        """grammar: (rows, token bitmasks) of structured outputs: those rows' approximate
        logits are masked before the candidates are picked, so their argmax is over the
        tokens the grammar allows (the kernel never answers a masked candidate)."""
        k = self.kernels
        if self.seven_bit:
            approx = k.head_w8a7(hidden, self.packed_int8, self.scale, self.vocab_size)
        else:
            approx = k.w8a8_linear(hidden, self.packed_int8, self.scale, self.vocab_size, None, True)
        if grammar is not None:
            k.apply_token_bitmask(approx, grammar[1], grammar[0])
        return k.greedy_head(approx, hidden, self.packed, GREEDY_CANDIDATES)


class StackForward:
    """The decoder layers as one kernels.DecoderStack call, for the steps whose attention
    is one flat kernel call: the same kernels in the same order as the model's Python loop
    over its layers, without ~300 Python calls."""

    def __init__(self, stack):
        self.stack = stack
        # Where LoRA adapters are served: their manager (lora/slots.py), which gives the
        # stack its layers' slots; a step with adapter rows then passes each row's slot.
        self.lora = None

    def attach_lora(self, manager) -> None:
        self.lora = manager

    def set_lora(self, layer: int, which: int, at, bt, ranks) -> None:
        """Layer `layer`'s linear `which` (0 qkv, 1 o, 2 gate_up, 3 down) gets LoRA slots."""
        self.stack.set_lora(layer, which, at, bt, ranks)

    def __call__(self, x, cos, sin, meta: AttentionMetadata, kv_caches):
        if meta.flat_kernel is None:
            return None
        step = self.lora.step if self.lora is not None else None
        if step is not None and step.row_slot is None:
            return None  # rows by torch's path: the Python loop adds them
        return self.stack.forward(x, cos, sin, kv_caches, meta.slot_mapping, meta.block_tables,
                                  meta.query_start_loc, meta.seq_lens, None if step is None else step.row_slot)


# Where the kernels run the model, torch's small CPU tensors come from the kernels' free
# lists (cpu_cache.cpp: a one-row step makes ~700 and glibc's frees and consolidations were
# ~6% of its main thread). Once per process, never undone; benchmarks set this False (before
# the first engine) to measure without.
CPU_TENSOR_CACHE = True
_cpu_cache_kernels = None  # the kernel module whose cache is installed


def install_cpu_tensor_cache(k) -> None:
    """Make torch's small CPU tensors come from kernel module k's free lists, once per
    process (each ISA build is a module of its own, with its own cache: one is installed)."""
    global _cpu_cache_kernels
    if _cpu_cache_kernels is None and k.install_cpu_cache():  # True once per process
        _cpu_cache_kernels = k


def cpu_tensor_cache_bytes() -> int:
    """Bytes held in the installed cache's free blocks (0 where none is installed)."""
    return 0 if _cpu_cache_kernels is None else int(_cpu_cache_kernels.cpu_cache_bytes())


def trim_cpu_tensor_cache() -> None:
    """Free the installed cache's free blocks (it stays installed)."""
    if _cpu_cache_kernels is not None:
        _cpu_cache_kernels.trim_cpu_cache()


def _linears(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Linear)]


def _weight_holders(model) -> list:
    """Everything that holds the kernels' packed weights: each Linear's method, the LM head
    and the greedy head, and the packed embedding's head method (quantization='gguf'), so
    that moving them leaves no second copy alive."""
    embedding_head = getattr(getattr(model.model.embed_tokens, "method", None), "method", None)
    held = [m.method for _, m in _linears(model)] + [getattr(model, "head", None), getattr(model, "greedy_head", None),
                                                     embedding_head]
    return [h for h in held if isinstance(h, (KernelWeight, GreedyHead))]


@dataclass
class CpuBackend(Backend):
    device: torch.device
    # The kernel build that runs ("avx512", "avx512_vnni", "avx2_vnni", "avx2"), or "generic" (torch's own ops).
    isa: str
    # The loaded kernel module of `isa`, or None.
    kernels: object | None
    dtype: torch.dtype
    linear: str                  # a LINEAR_METHODS key
    attention: str
    kv_cache_dtype: str
    norm: str                    # RMSNorm and SwiGLU
    rope: str                    # RoPE and the KV-cache write
    head: str                    # the LM head, and the greedy argmax
    deterministic: bool
    # The decoder layers as one C++ call (kernels.DecoderStack) where the kernels run the
    # model; not under tensor parallelism, whose all-reduces sit between the layers' ops.
    stack: bool = False
    tensor_parallel_size: int = 1

    family = "cpu"
    default_max_num_batched_tokens = CPU_MAX_NUM_BATCHED_TOKENS

    @classmethod
    def auto_dtype_for(cls, device: str, cpu_isa: str = "auto") -> torch.dtype:
        return auto_dtype(check(cpu_isa, None, "auto", False))

    @classmethod
    def auto_quantization(cls, model_config, tensor_parallel_size: int) -> str | None:
        """For a GGUF whose decoder linear weights are quantized, in bfloat16 on the kernels:
        - all Q4_1: w4a8, its 4-bit blocks the file's own (the loader hands them over), only
          the activations rounded (KL from float32 0.0023 against bf16's 0.0008
          on the default model, docs/benchmarks.md "Quality"), at about twice the c32
          throughput, with the end layers and the head in bf16 activations;
        - other quantized types (Q4_K_M files and the like): gguf, the file's own blocks in
          every layer as llama.cpp computes them, at ~1.2x the file's bytes in memory
          instead of a bf16 copy at 3-4x (docs/benchmarks.md "K-quants").
        Not in deterministic mode, with tensor parallelism or random weights (none of them
        is what a plain start asks for), nor where the dtype or the kernels are not bf16's."""
        from sluice.backends.select import parse_dtype
        from sluice.models.loader import gguf_linear_types, resolve_model
        m = model_config
        if m.deterministic or tensor_parallel_size > 1 or m.load_format != "auto":
            return None
        isa = check(m.cpu_isa, None, "auto", False)
        dtype = parse_dtype(m.dtype)
        if isa == "generic" or (auto_dtype(isa) if dtype is None else dtype) != torch.bfloat16:
            return None
        try:
            types = gguf_linear_types(resolve_model(m.model))
        except ValueError:
            return None  # an unknown model: the loader says so
        if types == {"Q4_1"}:
            return "w4a8"
        return "gguf" if types and not types & {"F32", "F16", "BF16", "F64"} else None

    @classmethod
    def check_settings(cls, model_config, cache_config, tensor_parallel_size: int) -> None:
        from sluice.backends.select import parse_dtype
        m, kv = model_config, cache_config.kv_cache_dtype
        refuse_gpu_modes(m.quantization, kv)
        isa = check(m.cpu_isa, m.quantization, kv, m.deterministic)
        dtype = parse_dtype(m.dtype)
        model_dtype(m, kv, isa, auto_dtype(isa) if dtype is None else dtype)

    @classmethod
    def build(cls, model_config, cache_config, dtype: torch.dtype | None, tensor_parallel_size: int = 1
              ) -> "CpuBackend":
        """The plan for this engine (each tensor-parallel rank runs the same one); loads
        (building on first use) the kernels it needs. dtype: the model dtype asked for
        (None: 'auto'). Raises ValueError, before any weight is loaded, for what cannot run."""
        m, kv = model_config, cache_config.kv_cache_dtype
        refuse_gpu_modes(m.quantization, kv)
        isa = check(m.cpu_isa, m.quantization, kv, m.deterministic)
        if m.quantization == "gguf" and tensor_parallel_size > 1:
            raise ValueError("quantization='gguf' runs in one process (its blocks are not split across ranks); "
                             "with tensor parallelism use w4a8, w8a8, int8 or none")
        k = None
        if isa != "generic":
            from sluice.backends.cpu import x86
            k = x86.load(isa)
            if k is None:
                if m.quantization_auto:  # chosen, not asked for: full precision instead
                    logger.warning("quantization=%r was the automatic choice; without the kernels it runs in "
                                   "full precision", m.quantization)
                    m.quantization, m.quantization_auto = None, False
                for mode, instead in _modes(m.quantization, kv, m.deterministic):
                    raise ValueError(f"{mode} needs sluice's C++ kernels, which failed to build here (see the log); "
                                     f"what works here: {instead}")
                logger.warning("sluice's C++ kernels (%s) did not build; torch's own ops run every layer", isa)
                isa = "generic"
        dtype = model_dtype(m, kv, isa, auto_dtype(isa) if dtype is None else dtype)
        # The kernels run the model's layers in bf16 (where they beat oneDNN at decode batch
        # sizes, and are the only bf16 path on CPUs without AVX-512) and, in deterministic
        # mode, in float32 too; float32 otherwise keeps torch's ops, the reference numerics of
        # the exact-match tests.
        run_model = k is not None and (m.deterministic or dtype == torch.bfloat16)
        if run_model:
            linear = {None: "kernels", "int8": "kernels-int8-invariant" if m.deterministic else "kernels-int8",
                      "w8a8": "kernels-w8a8", "w4a8": "kernels-w4a8", "gguf": "kernels-gguf"}[m.quantization]
            attention = "kernels-varlen"         # every token, prompt or decode, in one call
            norm = rope = "kernels"
            # The greedy argmax's approximate head (GreedyHead): int8 x int8 where vpdpbusd
            # runs it; on plain AVX2, int8 weights by 7-bit activations, which need no sign
            # trick (1.4x w8a8's speed there at 8-32 rows).
            head = ("kernels-gguf" if m.quantization == "gguf"  # the file's blocks: no approximate head
                    else "kernels" if m.deterministic else "kernels-greedy-w8a7" if isa == "avx2"
                    else "kernels-greedy-w8a8")
        else:
            from sluice.backends.platform import cpu
            prepack = dtype == torch.bfloat16 and cpu().onednn_bf16
            linear = {(None, False): "torch", (None, True): "onednn-bf16", ("int8", False): "torch-int8",
                      ("int8", True): "torch-int8+onednn-bf16"}.get((m.quantization, prepack), "torch")
            attention = "kernels-decode+sdpa" if k is not None else "torch-matmul-decode+sdpa"
            norm = rope = "torch"
            head = linear
        return cls(device=torch.device(m.device), isa=isa, kernels=k, dtype=dtype, linear=linear,
                   attention=attention, kv_cache_dtype=kv, norm=norm, rope=rope, head=head,
                   deterministic=m.deterministic, stack=run_model and tensor_parallel_size == 1,
                   tensor_parallel_size=tensor_parallel_size)

    def __post_init__(self):
        k = self.model_kernels
        if k is not None and CPU_TENSOR_CACHE:
            install_cpu_tensor_cache(k)
        self.ops = KernelOps(k) if k is not None else DecodeKernelOps() if self.kernels is not None else TORCH_OPS
        # Prompt chunks join the decodes in one flat kernel call (and the layers run as one
        # C++ call) rather than SDPA per chunk: with our bf16 kernels it is faster at every
        # prompt length measured, 128 to 8,000 tokens (docs/benchmarks.md). Float32 keeps
        # SDPA, the reference numerics of the exact-match tests; deterministic mode sends
        # every token through the kernel's one per-token routine (batch-invariant).
        self.flat_prefill = k is not None

    @property
    def model_kernels(self):
        """The kernels that run the model's layers (linear, norms, RoPE, attention for
        every token), or None where torch's ops do."""
        return self.kernels if self.linear.startswith("kernels") else None

    def padded_rows(self, n: int) -> int:
        # sluice's kernels run any row count as it is (no kernel per shape): padding would
        # only add rows to compute, a 129-row step running as 160.
        return n if self.model_kernels is not None else bucket(n)

    def line(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        kv = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        tp = (f" tp={self.tensor_parallel_size} (gloo all-reduce after attention and MLP; layers in Python)"
              if self.tensor_parallel_size > 1 else "")
        return (f"backend: {self.device.type} isa={self.isa} dtype={dtype} linear={self.linear} "
                f"attention={self.attention} kv={kv} norm={self.norm} rope={self.rope} head={self.head} "
                f"deterministic={'on' if self.deterministic else 'off'}{tp}")

    # -- the model --------------------------------------------------------------
    def check_model(self, arch) -> None:
        if self.kv_cache_dtype == "int8" and arch.head_dim % 4:
            raise ValueError(f"kv_cache_dtype='int8' takes head_dim a multiple of 4, this model has {arch.head_dim}")

    @torch.no_grad()
    def prepare(self, model, quantization: str | None = None, max_positions: int | None = None,
                with_head: bool = True) -> None:
        """Quantize if asked, then run every linear layer, RMSNorm, SwiGLU and RoPE through the
        plan's kernels, or prepack the weights for oneDNN. Deterministic mode also fixes the
        RoPE values. with_head=False: no LM head (a tensor-parallel rank other than 0, which
        never computes logits)."""
        scheme = quant.get(quantization)
        for name, module in _linears(model):
            if scheme is not None:
                scheme.quantize_rows(module)
            module.method = self._linear_method(model, name, module, scheme)
            # What the layer no longer needs (its weight, the file's blocks) back to the
            # system as the layers go, so that they and the packed copies never add up.
            return_freed_memory()
        self._finish(model, scheme, max_positions, with_head, huge_pages=True)

    @torch.no_grad()
    def update(self, model, quantization: str | None, written: dict[str, list[tuple[int, int]]],
               with_head: bool = True) -> None:
        """After a weight update wrote new checkpoint values into some parameters (`written`:
        parameter name -> its (first row, rows) ranges, as model.load_weights returns): quantize
        the new rows by the same scheme as at load, rebuild the methods of the layers they
        belong to and every fast path that holds weights. The result is what prepare() makes
        of a fresh load of the new weights."""
        scheme = quant.get(quantization)
        modules = dict(model.named_modules())
        changed: dict[str, Linear] = {}
        for pname, ranges in written.items():
            owner, _, kind = pname.rpartition(".")
            module = modules.get(owner)
            if isinstance(module, Linear):
                if scheme is not None and kind == "weight":
                    for start, rows in ranges:
                        scheme.quantize_rows(module, start, rows)
                changed[owner] = module
        for name, module in changed.items():
            module.method = self._linear_method(model, name, module, scheme)
        self._finish(model, scheme, None, with_head)

    def _linear_method(self, model, name: str, module: Linear, scheme):
        """A Linear's method under the plan, from its weight (dequantized when quantized)."""
        k = self.model_kernels
        if k is not None:
            if scheme is None:
                method = kernel_weight(k, module.weight, None, self.deterministic)
                if not weight_read_directly(name):
                    release_packed_weight(module)
            else:
                method = scheme.kernel_method(k, model, name, module, self.dtype, self.deterministic)
            # Row-parallel: each rank's partial sums stay float32 through the all-reduce and are
            # rounded once (Linear.forward), as one process rounds its whole sum (the tiny
            # model's logprobs: one process's to the bit, none of them when each rank rounded
            # its share; docs/design.md, "Tensor parallelism").
            return dataclasses.replace(method, out_float32=True) if module.reduce is not None else method
        packed = PackedWeight(prepack_weight(module.weight)) if self.linear.endswith("onednn-bf16") else None
        return packed if scheme is None else scheme.torch_method(module, self.dtype, packed)

    def _finish(self, model, scheme, max_positions: int | None, with_head: bool, huge_pages: bool = False) -> None:
        """What holds more than one layer's weights: the LM head, the greedy head, the decoder
        stack; and the ops and RoPE table of the kernels. huge_pages: first move the packed
        weights onto huge pages (at load; a weight update's new rows stay where they are
        made rather than copy every weight again)."""
        int8_head = None
        k = self.model_kernels
        emb = model.model.embed_tokens
        if isinstance(emb.method, PackedRows):  # an update: the table again (unless its new rows did that)
            if emb.weight.device.type == "meta":
                restore_packed_weight(emb, emb.method.method.packed)
            emb.method = None
        packed_head = (NotImplemented if scheme is None or k is None
                       else scheme.embedding_and_head(k, model, self.dtype, self.deterministic))
        if packed_head is NotImplemented and scheme is not None and model.lm_head is None and with_head:
            # Tied head: an int8 copy for the head; the embedding table stays as loaded.
            q, scale = quantize_per_channel(model.model.embed_tokens.weight)
            int8_head = (q, scale.to(self.dtype))
            del q, scale
        for module in model.modules():
            if hasattr(type(module), "ops"):
                module.ops = self.ops
        if k is None:
            if not with_head:
                return
            if model.lm_head is not None:
                model.head = model.lm_head
                return
            # Tied head: a packed copy beside the embedding table, and/or its int8 copy.
            emb = model.model.embed_tokens.weight.detach()
            packed = PackedWeight(prepack_weight(emb)) if self.linear.endswith("onednn-bf16") else None
            if int8_head is not None:
                from sluice.backends.cpu.linear import Int8Weight
                model.head = Int8Weight(*int8_head, emb, packed)
            else:
                model.head = packed
            return
        if with_head:
            self._heads(model, k, packed_head, int8_head)
        # Nothing but the model's holders may keep a tensor that moves (an original kept
        # alive here would stay beside its copy).
        own_blocks_head = packed_head is not NotImplemented
        del int8_head, packed_head
        head = getattr(model, "head", None)
        if (with_head and model.lm_head is None and not own_blocks_head and isinstance(head, KernelWeight)
                and head.packed is not None and head.packed.dim() == 4 and emb.weight.dtype == torch.bfloat16):
            # Tied: the embedding reads its rows from the head's packed copy of the same table
            # (the greedy head's int8 copy is made above; an update restores the table first).
            # Both read `head.packed` when called, so wherever the move below puts it; the
            # table is released first, so that it and the moved copies never add up.
            emb.method = PackedRows(head, *emb.weight.shape)
            release_packed_weight(emb, lambda: head.packed)
        # Every step streams these: one arena on huge pages (huge_pages.py), before the
        # decoder stack takes its references.
        if huge_pages:
            to_huge_pages(_weight_holders(model))
        if self.stack and model.stackable:
            model.fast_forward = StackForward(build_stack(model, k))
        if self.deterministic and model.rope_table is None:
            # One cos/sin table for every position, built once: computing them per batch runs
            # cos/sin over a tensor whose length depends on the batch, and vectorised and
            # scalar-tail elements of such kernels may round differently.
            model.fix_rope_tables(max_positions or model.arch.max_position_embeddings,
                                  model.model.embed_tokens.weight.dtype)

    def _heads(self, model, k, packed_head, int8_head) -> None:
        """model.head (float32 logits) and, on the greedy fast path, model.greedy_head."""
        if packed_head is not NotImplemented and model.lm_head is None:
            head = packed_head  # the embedding's packed blocks are the tied head's
        elif model.lm_head is None:  # tied head: its own packed copy of the embedding table
            head = kernel_weight(k, model.model.embed_tokens.weight, int8_head, self.deterministic)
        else:
            head = model.lm_head.method
        model.head = dataclasses.replace(head, out_float32=True)  # float32 logits
        if self.head.startswith("kernels-greedy-") and head.packed is not None:
            # The same weight the bf16 head multiplies by, in int8 for the greedy fast path.
            q, scale = quantize_per_channel(model.head_weight())
            seven_bit = self.head == "kernels-greedy-w8a7"
            packed_int8 = k.head_w8a7_pack(q) if seven_bit else k.w8a8_pack_weight(q)
            model.greedy_head = GreedyHead(k, packed_int8, scale.float().contiguous(), model.head.packed,
                                           model.arch.vocab_size, seven_bit)

    def lora_kernel(self):
        """Where the kernels run the model: lora.cpp's one call per layer for every adapter
        of the step (each row alone: batch-invariant, the same bits on every build)."""
        k = self.model_kernels
        return None if k is None else k.lora_sgmv

    # -- the KV cache -------------------------------------------------------------
    def kv_row_bytes(self, arch) -> int:
        if self.kv_cache_dtype != "int8":
            return super().kv_row_bytes(arch)
        return arch.head_dim + INT8_ROW_EXTRA  # int8 values and a float32 scale per token and kv head

    def allocate_kv_cache(self, num_layers, num_kv_heads, num_blocks, block_size, head_dim):
        # On huge pages (huge_pages.py): a decode reads its blocks scattered over the cache.
        if self.kv_cache_dtype != "int8":
            shape, dtype = (num_kv_heads, num_blocks + 1, block_size, head_dim), self.dtype
        else:
            shape, dtype = (num_kv_heads, num_blocks + 1, block_size, head_dim + INT8_ROW_EXTRA), torch.uint8
        return [(huge_zeros(shape, dtype), huge_zeros(shape, dtype)) for _ in range(num_layers)]

    # -- one step -----------------------------------------------------------------
    def attention_metadata(self, batch: FlatBatch) -> AttentionMetadata:
        dev, bs = self.device, batch.block_size
        qs, seq_lens = batch.query_start, batch.seq_lens
        block_tables = _padded_tables(batch.block_ids)
        prefills: list[PrefillChunk] = []
        decode_rows: list[int] = []
        decode_reqs: list[int] = []
        # Where the kernels take prompt chunks too, every step is one flat call and needs no
        # per-request records: the loop below is for the SDPA path only.
        for i in range(0 if self.flat_prefill else len(seq_lens)):
            start, end = qs[i], qs[i + 1]
            if end - start == 1:
                decode_rows.append(start)
                decode_reqs.append(i)
            else:  # the chunk goes through SDPA, with its own record
                seq_len = seq_lens[i]
                start_pos = seq_len - (end - start)
                mask = None
                if start_pos > 0:
                    # Query i sits at position start_pos + i and sees keys 0..start_pos + i.
                    qpos = torch.arange(start_pos, seq_len)[:, None]
                    mask = (torch.arange(seq_len)[None, :] <= qpos).to(dev)
                n_blocks = -(-seq_len // bs)
                prefills.append(PrefillChunk(start, end, start_pos, seq_len,
                                             torch.tensor(batch.block_ids[i][:n_blocks], device=dev), mask))
        seq_lens_t = torch.tensor(seq_lens, dtype=torch.long)
        # One flat kernel call computes the whole step: always where the kernels run the
        # model, and otherwise for steps with no SDPA prompt chunk.
        flat = self.kernels if self.kernels is not None and (self.flat_prefill or not prefills) else None
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(batch.slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qs, dtype=torch.long, device=dev),
            seq_lens=seq_lens_t.to(dev),
            block_tables=block_tables.to(dev),
            prefills=prefills,
            flat_kernel=flat,
            decode_kernel=self.kernels,
        )
        # Decode rows get their own index tensors only where attention splits them from
        # the prefills; a step computed by one flat kernel call needs none.
        if decode_rows and flat is None:
            sel = torch.tensor(decode_reqs, dtype=torch.long)
            d_lens = seq_lens_t[sel]
            n_blocks = -(-int(d_lens.max()) // bs)
            meta.decode_block_tables = block_tables[sel, :n_blocks].to(dev)
            if self.kernels is None:
                meta.decode_mask = (torch.arange(n_blocks * bs)[None, :] < d_lens[:, None])[None, :, None, :].to(dev)
            meta.decode_token_idx = torch.tensor(decode_rows, dtype=torch.long, device=dev)
            meta.decode_seq_lens = d_lens.to(dev)
        return meta

    def group_metadata(self, base: AttentionMetadata, batch: FlatBatch) -> AttentionMetadata:
        if base.flat_kernel is None:
            return self.attention_metadata(batch)
        # One flat kernel call per layer reads only the tables and the slots: the rest is shared.
        return dataclasses.replace(base, slot_mapping=torch.tensor(batch.slots, dtype=torch.long, device=self.device),
                                   block_tables=_padded_tables(batch.block_ids).to(self.device), layer_meta=None)

    def greedy_tokens(self, model, hidden: torch.Tensor, grammar=None) -> torch.Tensor | None:
        head = getattr(model, "greedy_head", None)
        if head is None or hidden.dtype != torch.bfloat16:
            return None
        return head(hidden, grammar)

    def sampler_ops(self) -> tuple:
        k = self.kernels
        return (getattr(k, "argmax_rows", None), getattr(k, "apply_token_bitmask", None),
                getattr(k, "sample_rows", None))


def _padded_tables(block_ids: list[list[int]]) -> torch.Tensor:
    """[B, max blocks] from per-request tables, padded with 0: one tensor built from padded
    lists (a per-request copy would be B small ops per step)."""
    width = max(len(b) for b in block_ids)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.long)


def build_stack(model, k):
    """The decoder layers as one kernels.DecoderStack: the same kernels in the same order
    as the model's Python loop over its layers."""
    def linear(module):
        w = module.method
        bias = None if module.bias is None else module.bias.detach()
        return (w.n, w.packed, w.q_packed, w.qscale, float(w.int8_max_rows), bias, w.w8a8, w.w4a8, w.w4d, w.w4m,
                w.w4nib, w.w4nib_scales)

    first = model.model.layers[0].self_attn
    stack = k.DecoderStack(first.num_heads, first.num_kv_heads, first.head_dim, first.scale, model.model.norm.eps,
                           model.model.norm.weight.detach())
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        stack.add_layer(linear(attn.qkv_proj), linear(attn.o_proj), linear(mlp.gate_up_proj),
                        linear(mlp.down_proj), layer.input_layernorm.weight.detach(),
                        layer.post_attention_layernorm.weight.detach())
    return stack
