"""Which part of each layer a tensor-parallel rank holds (Megatron's split).

Attention is split by KV-head groups: rank r holds a contiguous run of the KV heads and
the query heads that read them, so every rank's attention is complete for its heads and
the KV cache of a rank holds its KV heads only. The MLP is split along its intermediate
dimension. Q/K/V and gate/up are column-parallel (each rank computes its own outputs);
the attention output and down projections are row-parallel (each rank multiplies its
slice of the inputs, and one all-reduce sums the partial outputs): one all-reduce per
attention block and one per MLP block. Uneven splits are allowed (SmolLM2's 3 KV heads
over 2 ranks: 2 and 1), so any size up to the number of KV heads works.
"""
from __future__ import annotations

from dataclasses import dataclass


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of n items cut into `parts` contiguous runs, the
    first n % parts runs one longer."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


@dataclass(frozen=True)
class TPShard:
    """This process's place in a tensor-parallel group; the default is one process."""
    rank: int = 0
    size: int = 1
    # What row-parallel layers all-reduce over (tensor_parallel.TPGroup); None: one rank.
    group: object | None = None


SINGLE = TPShard()


def check_tp_size(size: int, num_kv_heads: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size > num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} exceeds this model's {num_kv_heads} KV heads: each rank "
                         f"holds at least one KV head; use a size of at most {num_kv_heads}")
