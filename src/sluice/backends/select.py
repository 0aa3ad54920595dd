"""The one place that decides which implementation runs each op.

`select(model_config, cache_config)` runs at engine start, before any weight is loaded.
From the device, the CPU's features (backends/platform.py), the `cpu_isa` setting, the
dtype, the quantization, the KV-cache dtype and deterministic mode it picks:

- the kernel build (worker/kernels: "avx512", "avx2_vnni", "avx2") or none ("generic":
  torch's ops);
- the linear method, by name from LINEAR_METHODS (backends/linear_methods.py implements
  them, backends/prepare.py sets them);
- attention for prompt chunks and decodes, per KV dtype;
- RMSNorm, SwiGLU, RoPE + cache write, and the LM head / greedy argmax;

and returns it as a BackendPlan, logged in one line. Every combination it cannot run is
refused here with a ValueError that says what is missing and what would work.

Adding an ISA is one entry in worker/kernels VARIANTS and platform.ISA_NEEDS (and, if
its intrinsics are not AVX-512's, a header like avx2/avx512_on_avx2.h); a CUDA backend
is a branch of `select` naming its own methods. The model files and the runner only
follow the plan.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

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
}


@dataclass(frozen=True)
class BackendPlan:
    device: str
    # The kernel build that runs ("avx512", "avx2_vnni", "avx2"), or "generic" (torch's own ops).
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

    @property
    def model_kernels(self):
        """The kernels that run the model's layers (linear, norms, RoPE, attention for
        every token), or None where torch's ops do."""
        return self.kernels if self.linear.startswith("kernels") else None

    def line(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        kv = dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype
        tp = (f" tp={self.tensor_parallel_size} (gloo all-reduce after attention and MLP; layers in Python)"
              if self.tensor_parallel_size > 1 else "")
        return (f"backend: {self.device} isa={self.isa} dtype={dtype} linear={self.linear} "
                f"attention={self.attention} kv={kv} norm={self.norm} rope={self.rope} head={self.head} "
                f"deterministic={'on' if self.deterministic else 'off'}{tp}")


def _modes(quantization, kv_cache_dtype, deterministic) -> list[tuple[str, str]]:
    """The modes that only sluice's kernels run, with what works instead."""
    out = []
    if deterministic:
        out.append(("deterministic mode", "the default (non-deterministic) mode"))
    if quantization in ("w8a8", "w4a8"):
        out.append((f"quantization={quantization!r}", "quantization='int8', or none"))
    if kv_cache_dtype == "int8":
        out.append(("kv_cache_dtype='int8'", "kv_cache_dtype='auto'"))
    return out


def check(device: str, cpu_isa: str, quantization: str | None, kv_cache_dtype: str, deterministic: bool) -> str:
    """The kernel variant this configuration runs ("generic" for none), or a one-line
    ValueError for what cannot run here; reads the CPU, builds nothing."""
    if not device.startswith("cpu"):
        return "generic"
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


def auto_dtype(device: str, isa: str) -> torch.dtype:
    """dtype='auto': bfloat16 wherever sluice's kernels run the model (they read bf16
    weights, half float32's bytes, and compute in float32: docs/design.md says what that
    costs in quality) or the device computes bf16 itself; float32 elsewhere."""
    if device.startswith("cuda") or isa != "generic":
        return torch.bfloat16
    from sluice.backends.platform import cpu
    return torch.bfloat16 if cpu().onednn_bf16 and "avx512_bf16" in cpu().flags else torch.float32


def model_dtype(model_config, kv_cache_dtype: str, isa: str) -> torch.dtype:
    """The dtype the model runs in ('auto' resolved for kernel build `isa`), or a one-line
    ValueError for a mode that dtype cannot run."""
    from sluice.config import resolve_dtype
    m = model_config
    dtype = auto_dtype(m.device, isa) if m.dtype == "auto" else resolve_dtype(m.dtype, m.device)
    if m.deterministic and dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"deterministic mode supports float32 and bfloat16, not {dtype}")
    if (m.quantization is not None or kv_cache_dtype == "int8") and not (m.device.startswith("cpu")
                                                                         and dtype == torch.bfloat16):
        got = f"dtype={str(dtype).removeprefix('torch.')} on {m.device!r}"
        if m.dtype == "auto":
            got += " (what dtype='auto' picks here; ask for dtype='bfloat16')"
        mode = f"quantization={m.quantization!r}" if m.quantization is not None else "kv_cache_dtype='int8'"
        raise ValueError(f"{mode} needs dtype bfloat16 on the CPU; got {got}")
    return dtype


def select(model_config, cache_config, tensor_parallel_size: int = 1, log: bool = True) -> BackendPlan:
    """The plan for this engine (each tensor-parallel rank runs the same one); loads
    (building on first use) the kernels it needs. Raises ValueError, before any weight is
    loaded, for what cannot run here."""
    m, kv = model_config, cache_config.kv_cache_dtype
    isa = check(m.device, m.cpu_isa, m.quantization, kv, m.deterministic)
    k = None
    if isa != "generic":
        from sluice.worker import kernels
        k = kernels.load(isa)
        if k is None:
            for mode, instead in _modes(m.quantization, kv, m.deterministic):
                raise ValueError(f"{mode} needs sluice's C++ kernels, which failed to build here (see the log); "
                                 f"what works here: {instead}")
            logger.warning("sluice's C++ kernels (%s) did not build; torch's own ops run every layer", isa)
            isa = "generic"
    dtype = model_dtype(m, kv, isa)
    # The kernels run the model's layers in bf16 (where they beat oneDNN at decode batch
    # sizes, and are the only bf16 path on CPUs without AVX-512) and, in deterministic
    # mode, in float32 too; float32 otherwise keeps torch's ops, the reference numerics of
    # the exact-match tests.
    run_model = k is not None and (m.deterministic or dtype == torch.bfloat16)
    if run_model:
        linear = {None: "kernels", "int8": "kernels-int8-invariant" if m.deterministic else "kernels-int8",
                  "w8a8": "kernels-w8a8", "w4a8": "kernels-w4a8"}[m.quantization]
        attention = "kernels-varlen"         # every token, prompt or decode, in one call
        norm = rope = "kernels"
        # The greedy argmax's approximate head (prepare.GreedyHead): int8 x int8 where
        # vpdpbusd runs it; on plain AVX2, int8 weights by 7-bit activations, which need no
        # sign trick (1.4x w8a8's speed there at 8-32 rows).
        head = "kernels" if m.deterministic else "kernels-greedy-w8a7" if isa == "avx2" else "kernels-greedy-w8a8"
    else:
        from sluice.backends.platform import cpu
        prepack = m.device.startswith("cpu") and dtype == torch.bfloat16 and cpu().onednn_bf16
        linear = {(None, False): "torch", (None, True): "onednn-bf16", ("int8", False): "torch-int8",
                  ("int8", True): "torch-int8+onednn-bf16"}.get((m.quantization, prepack), "torch")
        attention = "kernels-decode+sdpa" if k is not None else "torch-matmul-decode+sdpa"
        norm = rope = "torch"
        head = linear
    plan = BackendPlan(device=m.device, isa=isa, kernels=k, dtype=dtype, linear=linear, attention=attention,
                       kv_cache_dtype=kv, norm=norm, rope=rope, head=head, deterministic=m.deterministic,
                       stack=run_model and tensor_parallel_size == 1, tensor_parallel_size=tensor_parallel_size)
    if log:
        logger.info("%s", plan.line())
    return plan
