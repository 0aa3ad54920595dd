"""The batch shapes the runner pads a step to (its own module: the speculation gate keys
its measured step times by the same sizes, without importing the runner)."""
from __future__ import annotations

from sluice.core.kv_cache_manager import cdiv


def bucket(n: int) -> int:
    """Round a batch's row count up to one of a few sizes. oneDNN builds a kernel per new
    matrix shape (~1 ms per linear layer, 100+ ms per step: measured), and continuous
    batching would otherwise see a new row count almost every step."""
    if n <= 4:
        return n
    for limit, step in ((64, 8), (512, 32)):
        if n <= limit:
            return cdiv(n, step) * step
    return cdiv(n, 128) * 128
