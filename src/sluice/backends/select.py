"""The one place that decides which backend runs an engine.

`select(model_config, cache_config)` runs at engine start, before any weight is loaded:
from the device it picks the family (FAMILIES: cpu -> backends/cpu/backend.py, cuda ->
backends/cuda/backend.py), which decides every "which implementation runs" question from
the machine and the settings and returns its Backend, logged as one plan line. Every
combination a family cannot run is refused there with a ValueError that says what is
missing and what would work.

`check_config(config)` runs those refusals (and the device's defaults) without loading
anything; EngineConfig.validate calls it, so a bad setting fails when the settings are made.
"""
from __future__ import annotations

import importlib
import logging

import torch

logger = logging.getLogger(__name__)

# Device type -> the module and class of its backend family.
FAMILIES = {
    "cpu": ("sluice.backends.cpu.backend", "CpuBackend"),
    "cuda": ("sluice.backends.cuda.backend", "CudaBackend"),
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def auto_device() -> str:
    """What device='auto' means here: cuda where torch sees a GPU, else cpu."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def family(device: str):
    """The Backend class of a device ("cpu", "cuda", "cuda:1", "auto"); ValueError for another."""
    if device == "auto":
        device = auto_device()
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"device={device!r} is not a torch device; sluice runs on auto, {', '.join(FAMILIES)}") \
            from None
    if kind not in FAMILIES:
        raise ValueError(f"device={device!r}: sluice runs on {', '.join(FAMILIES)}")
    module, name = FAMILIES[kind]
    return getattr(importlib.import_module(module), name)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype | None:
    """A dtype setting as a torch dtype; None for 'auto' (the backend's choice)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype == "auto":
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}; got {dtype!r}")
    return DTYPES[dtype]


def resolve_dtype(dtype: str | torch.dtype, device: str, cpu_isa: str = "auto") -> torch.dtype:
    """'auto' picks what the device's backend computes fastest (bfloat16 where sluice's CPU
    kernels or the hardware compute it, else float32)."""
    parsed = parse_dtype(dtype)
    if parsed is not None:
        return parsed
    return family(device).auto_dtype_for(device, cpu_isa)


def check_config(config) -> None:
    """The device's refusals for these settings, and its defaults (the step budget), before
    anything loads; builds no kernel."""
    m, c, s = config.model, config.cache, config.scheduler
    if m.device == "auto":
        m.device = auto_device()
    cls = family(m.device)
    if s.max_num_batched_tokens is None:
        s.max_num_batched_tokens = cls.default_max_num_batched_tokens
    tp = config.parallel.tensor_parallel_size
    if m.quantization == "auto":
        m.quantization = cls.auto_quantization(m, tp)
        m.quantization_auto = m.quantization is not None
        if m.quantization is not None:
            logger.info("quantization=%r: the checkpoint's quantized weights run in their own form here "
                        "(--quantization none, or quantization=None, for full precision)", m.quantization)
    if s.async_scheduling is None:
        s.async_scheduling = cls.overlap_pays and tp == 1
    elif s.async_scheduling and tp > 1:
        raise ValueError("async_scheduling needs tensor_parallel_size=1: the other ranks build each step's batch "
                         "from its token ids, which a step planned ahead does not have yet; what works: "
                         "async_scheduling=False")
    cls.check_settings(m, c, tp)


def select(model_config, cache_config, tensor_parallel_size: int = 1, log: bool = True):
    """The backend for this engine (each tensor-parallel rank runs the same one); loads
    (building on first use) the kernels it needs. Raises ValueError, before any weight is
    loaded, for what cannot run here."""
    m = model_config
    backend = family(m.device).build(m, cache_config, parse_dtype(m.dtype), tensor_parallel_size)
    if log:
        logger.info("%s", backend.line())
    return backend
