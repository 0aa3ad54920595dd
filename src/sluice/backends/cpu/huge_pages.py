"""CPU tensors on transparent huge pages: the KV cache, which a step reads scattered, and
the packed weights, which every step streams.

A decode's attention reads each sequence's K/V rows block by block through its block table,
2 KB (a bf16 block of 16 rows of 64) at a time from all over a cache of hundreds of MB. On
4 KB pages nearly every such block lands on a page the TLB does not hold, and the hardware's
prefetchers stop at every page boundary. Linux hands a process 2 MB pages where it asks for
them (`madvise(MADV_HUGEPAGE)`), which is what most distributions' default THP setting
("madvise") waits for; torch's allocator never asks. So the cache is mapped here, advised,
and wrapped as a tensor, and the packed weights are copied into one such arena. Reading 2
KB blocks in a random order went from 34 to 52 GB/s on the Zen 5 box (machine_limits.py);
what the kernels gain is smaller and varies between sittings (docs/benchmarks.md, "Huge
pages").

Where the kernel refuses (THP "never", another OS) the mapping stays on small pages: the
same memory, zeroed, just as torch.zeros would give.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import mmap

import torch

from sluice.heap import return_freed_memory

logger = logging.getLogger(__name__)

# Below this a tensor is not worth a mapping of its own (a 2 MB page would not fit whole).
MIN_BYTES = 4 << 20
# How many bytes of originals to_huge_pages frees between two hand-backs of their pages.
TRIM_BYTES = 64 << 20
_warned = False


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype, touch: bool = True) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype) on the CPU, in an anonymous mapping advised for
    transparent huge pages (plain torch.zeros below MIN_BYTES). The mapping lives as long
    as the tensor (and any view of it). touch=False: its pages are faulted in by their first
    write, not now (for a tensor the caller is about to fill)."""
    global _warned
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)  # before the first touch: faults then take 2 MB pages
    except OSError as e:
        if not _warned:
            logger.info("huge pages refused (%s): the KV cache and weights stay on 4 KB pages", e)
            _warned = True
    # frombuffer's tensor keeps `region` alive. Anonymous memory reads as zeros, but is
    # written here all the same: every page faults in now (as torch.zeros's memset does),
    # not at a step's first write to it, which would then zero 2 MB inside the step.
    t = torch.frombuffer(region, dtype=torch.uint8).view(dtype).view(shape)
    return t.zero_() if touch else t


def to_huge_pages(holders: list) -> int:
    """Copy every tensor field of `holders` (dataclass instances: the kernels' packed
    weights) into one arena on huge pages and point the fields at the copies, 64-byte
    aligned; a tensor two fields share stays shared. The same values, so the same bits.
    Fields holding a tensor that is empty, not on the CPU or not contiguous keep theirs.
    Returns the bytes moved (0 where the arena would be too small to matter).

    The move never holds the weights twice: the arena's pages are faulted in by the copies,
    one tensor at a time, and each original is freed once its last field points at its
    copy, its pages handed back as the move goes (return_freed_memory). Zeroing the arena
    first and freeing the originals at the end peaked at twice the packed weights (an 8B
    model's bf16 ones: 32 GB for 16)."""
    fields, sizes = _movable(holders)
    total = sum(sizes.values())
    if total < MIN_BYTES:
        return 0
    arena = huge_zeros((total,), torch.uint8, touch=False)
    copies, offset, freed = {}, 0, 0
    for h, name in fields:
        t = getattr(h, name)
        key = _key(t)
        if key not in copies:
            n = t.numel() * t.element_size()
            copies[key] = arena[offset:offset + n].view(t.dtype).view(t.shape).copy_(t)
            offset += sizes[key]
            freed += n
        setattr(h, name, copies[key])
        del t
        if freed >= TRIM_BYTES:
            return_freed_memory()
            freed = 0
    return_freed_memory()
    return total


def _movable(holders: list) -> tuple[list[tuple[object, str]], dict[tuple, int]]:
    """The (holder, field) pairs to_huge_pages moves, and each distinct tensor's bytes in the
    arena (64-byte aligned), by _key. Only names: the caller fetches each tensor as it
    copies it, so that nothing here keeps an original alive."""
    fields, sizes, seen = [], {}, set()
    for h in holders:
        if id(h) in seen:  # listed twice: moved once (a second visit would find the copy)
            continue
        seen.add(id(h))
        for f in dataclasses.fields(h):
            t = getattr(h, f.name)
            if isinstance(t, torch.Tensor) and t.numel() > 0 and t.device.type == "cpu" and t.is_contiguous():
                fields.append((h, f.name))
                sizes.setdefault(_key(t), (t.numel() * t.element_size() + 63) // 64 * 64)
    return fields, sizes


def _key(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape)
