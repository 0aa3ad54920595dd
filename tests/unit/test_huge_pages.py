"""The CPU backend's huge-page tensors (backends/cpu/huge_pages.py): zeroed, writable,
alive as long as any view, advised for transparent huge pages, and the packed weights'
arena keeps values and sharing."""
from __future__ import annotations

import dataclasses
import gc
import mmap
import os
import sys

import pytest
import torch

from sluice.backends.cpu.huge_pages import MIN_BYTES, huge_zeros, to_huge_pages


# Whether this kernel has transparent huge pages to advise (madvise fails without them).
THP = (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
       and os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"))


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping that holds `addr` (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def test_huge_zeros_is_zeroed_writable_and_outlives_its_base():
    t = huge_zeros((3, 700, 16, 64), torch.bfloat16)
    assert t.shape == (3, 700, 16, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % 64 == 0
    assert not t.any()
    view = t[2]
    del t
    gc.collect()
    view.fill_(1.5)  # the mapping is still there
    assert float(view.float().sum()) == 1.5 * 700 * 16 * 64


@pytest.mark.skipif(not THP, reason="no transparent huge pages in this kernel")
def test_huge_zeros_asks_for_huge_pages():
    t = huge_zeros((MIN_BYTES,), torch.uint8)
    assert "hg" in _vm_flags(t.data_ptr())  # MADV_HUGEPAGE was taken
    small = huge_zeros((1024,), torch.uint8)  # too small to be worth a mapping: torch's own
    assert small.shape == (1024,) and not small.any()


@dataclasses.dataclass
class _Packed:
    a: torch.Tensor
    b: torch.Tensor
    n: int = 0


def test_to_huge_pages_keeps_values_and_sharing():
    big = torch.randint(0, 255, (MIN_BYTES,), dtype=torch.uint8)
    scales = torch.randn(1000, 3)
    empty = torch.empty(0)
    x, y = _Packed(big, scales), _Packed(scales, empty, 7)
    moved = to_huge_pages([x, y])
    assert moved >= MIN_BYTES
    assert torch.equal(x.a, big) and torch.equal(x.b, scales) and torch.equal(y.a, scales)
    assert x.a.data_ptr() != big.data_ptr()  # a copy ...
    assert x.b.data_ptr() == y.a.data_ptr()  # ... one for both fields that shared it
    assert y.b is empty and y.n == 7
    assert all(t.data_ptr() % 64 == 0 for t in (x.a, x.b))
    if THP:
        assert "hg" in _vm_flags(x.a.data_ptr())
    # Too little to matter: left where it is.
    z = _Packed(scales, scales)
    assert to_huge_pages([z]) == 0 and z.a is scales


def _peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size (VmHWM) starts again from now
        return True
    except OSError:
        return False


def _kb(key: str) -> int:
    return int(open("/proc/self/status").read().split(key + ":")[1].split()[0])


def test_to_huge_pages_never_holds_the_weights_twice():
    """Each original is freed (and its pages handed back) as its copy is made: moving 384 MB
    grows the peak by far less than the 384 MB that zeroing the arena first and freeing the
    originals at the end added. A holder listed twice is moved once."""
    n, size = 24, 16 << 20
    holders = [_Packed(torch.full((size,), i, dtype=torch.uint8), torch.empty(0)) for i in range(n)]
    if not _peak_reset():
        pytest.skip("no /proc/self/clear_refs to reset the peak resident size")
    before = _kb("VmRSS")
    moved = to_huge_pages(holders + holders[:2])
    grew_mb = (_kb("VmHWM") - before) / 1024
    assert moved == n * size
    assert all(int(h.a[0]) == i and int(h.a[-1]) == i for i, h in enumerate(holders))
    assert grew_mb < n * size / 2 / 2**20, f"the move grew the peak by {grew_mb:.0f} MB"
