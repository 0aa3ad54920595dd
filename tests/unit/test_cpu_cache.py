"""The caching allocator for torch's small CPU tensors (backends/cpu/x86/cpu_cache.cpp),
installed once per process where the kernels run a model: tensors keep their own bytes
whatever is freed and made around them, freed small blocks are reused, big ones are not
cached, and the free lists stay within their bound."""
from __future__ import annotations

import torch

from sluice.backends.cpu import backend as cpu_backend

MAX_BLOCK = 64 * 1024
MAX_CACHED = 64 << 20


def installed(kernel_isa):
    from sluice.backends.cpu import x86
    cpu_backend.install_cpu_tensor_cache(x86.load(kernel_isa))
    assert cpu_backend._cpu_cache_kernels is not None
    cpu_backend.trim_cpu_tensor_cache()
    return cpu_backend.cpu_tensor_cache_bytes


def test_installed_once_per_process(kernel_isa):
    installed(kernel_isa)
    from sluice.backends.cpu import x86
    # A build's own install finds the cache in place, its own or another build's (the
    # first build to install it is the session's best one, so the others see another's).
    assert x86.load(kernel_isa).install_cpu_cache() is False


def test_tensors_keep_their_bytes(kernel_isa):
    installed(kernel_isa)
    sizes = [1, 7, 16, 64, 255, 256, 1000, 1024, 1025, 4097, 16384, MAX_BLOCK // 4, MAX_BLOCK // 4 + 1, 300_000]
    live = []
    gen = torch.Generator().manual_seed(0)
    for round_ in range(6):
        for n in sizes:
            t = torch.randint(0, 255, (n,), dtype=torch.uint8, generator=gen)
            assert t.data_ptr() % 64 == 0
            live.append((t, t.clone()))
        # Free every other tensor, then make more of the same sizes: reused blocks must
        # not be anyone's still.
        live = [p for i, p in enumerate(live) if (i + round_) % 2]
        for t, want in live:
            assert torch.equal(t, want)
    assert len({t.data_ptr() for t, _ in live}) == len(live)


def test_small_blocks_are_reused_big_ones_not(kernel_isa):
    cached = installed(kernel_isa)
    keep = [torch.empty(5000, dtype=torch.uint8) for _ in range(8)]
    before = cached()
    ptrs = {t.data_ptr() for t in keep}
    del keep
    assert cached() >= before + 8 * 5000
    again = [torch.empty(5000, dtype=torch.uint8) for _ in range(8)]
    assert {t.data_ptr() for t in again} == ptrs  # the same blocks back
    assert cached() == before
    big = torch.empty(MAX_BLOCK + 1, dtype=torch.uint8)
    del big
    assert cached() == before


def test_free_lists_are_bounded(kernel_isa):
    cached = installed(kernel_isa)
    many = [torch.empty(MAX_BLOCK // 2, dtype=torch.uint8) for _ in range(4 * MAX_CACHED // MAX_BLOCK)]
    del many
    assert MAX_CACHED - MAX_BLOCK < cached() <= MAX_CACHED
    cpu_backend.trim_cpu_tensor_cache()
    assert cached() == 0


def test_torch_ops_run_on_it(kernel_isa):
    installed(kernel_isa)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(33, 65, generator=gen)
    b = torch.randn(65, 17, generator=gen)
    want = (a.double() @ b.double()).float()
    for _ in range(3):
        torch.testing.assert_close(a @ b, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.cat([a, a]).sum(0), 2 * a.sum(0))


def test_onednn_matmul_runs_on_it(kernel_isa):
    """oneDNN's matmul takes its scratch through raw_allocate, which asserts the block's
    context is its data pointer."""
    installed(kernel_isa)
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(3, 5, 64, generator=gen).bfloat16()
    b = torch.randn(3, 64, 7, generator=gen).bfloat16()
    want = torch.bmm(a.float(), b.float())
    torch.testing.assert_close(torch.bmm(a, b).float(), want, rtol=2e-2, atol=2e-2)
    x = torch.empty(1000, dtype=torch.uint8)
    assert x.untyped_storage().data_ptr() == x.data_ptr()
