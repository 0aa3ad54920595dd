"""Paged attention: the C++ decode kernel against the torch path, and against dense
attention over the same tokens."""
from __future__ import annotations

import pytest
import torch

from sluice.backends.base import AttentionMetadata
from sluice.backends.cpu.ops import paged_attention


def make_case(dtype, num_kv_heads=3, group=3, head_dim=64, block_size=16, seqs=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 64
    k_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    lens = torch.tensor([1, 5, 16, 17, 40, 63, 100][:seqs])
    nb = int((lens.max() + block_size - 1) // block_size)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:nb] for _ in range(seqs)])
    q = torch.randn(seqs, num_kv_heads * group, head_dim, generator=g).to(dtype)
    mask = (torch.arange(nb * block_size)[None, :] < lens[:, None])[None, :, None, :]
    meta = AttentionMetadata(slot_mapping=None, query_start_loc=torch.arange(seqs + 1), seq_lens=lens,
                             block_tables=tables,
                             decode_token_idx=torch.arange(seqs), decode_block_tables=tables, decode_mask=mask,
                             decode_seq_lens=lens, prefills=[])
    return q, k_cache, v_cache, meta


def dense_reference(q, k_cache, v_cache, meta, scale):
    out = []
    hkv, _, bs, d = k_cache.shape
    for i, n in enumerate(meta.decode_seq_lens.tolist()):
        blocks = meta.decode_block_tables[i]
        k = k_cache[:, blocks].reshape(hkv, -1, d)[:, :n].float()
        v = v_cache[:, blocks].reshape(hkv, -1, d)[:, :n].float()
        qi = q[i].float().view(hkv, -1, d)
        p = torch.softmax(qi @ k.transpose(-1, -2) * scale, dim=-1)
        out.append((p @ v).reshape(-1, d))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_matches_dense(dtype, tol):
    q, kc, vc, meta = make_case(dtype)
    got = paged_attention(q, kc, vc, meta, 0.125)
    ref = dense_reference(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_attention_kernel_matches_dense(dtype, tol, isa_kernels):
    q, kc, vc, meta = make_case(dtype)
    meta.decode_kernel = isa_kernels
    got = paged_attention(q, kc, vc, meta, 0.125)
    ref = dense_reference(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(got.float(), ref, atol=tol, rtol=tol)


def test_kernel_handles_other_head_shapes(isa_kernels):
    """Group sizes and head dims off the vector fast path still give the right answer."""
    mod = isa_kernels
    for kv, group, d in [(2, 1, 32), (1, 4, 24), (4, 2, 128)]:
        q, kc, vc, meta = make_case(torch.float32, num_kv_heads=kv, group=group, head_dim=d, seed=kv + d)
        meta.decode_kernel = mod
        torch.testing.assert_close(paged_attention(q, kc, vc, meta, d ** -0.5),
                                   dense_reference(q, kc, vc, meta, d ** -0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 8])
def test_compiled_shapes_give_the_generic_paths_bits(group, isa_kernels):
    """float32, head_dim 64 runs a path compiled for the shape; zero-padding head_dim to 80
    sends the same numbers through the generic loops, whose extra terms are exact zeros:
    the outputs must agree bit for bit; likewise 128 and 144. (bf16 caches of these shapes
    take the bf16 dot-product routine, checked against float32 below.)"""
    mod = isa_kernels
    dtype = torch.float32
    for d, padded in [(64, 80), (128, 144)]:
        q, kc, vc, meta = make_case(dtype, num_kv_heads=2, group=group, head_dim=d, seed=group + d)
        pad = lambda t: torch.nn.functional.pad(t, (0, padded - d))  # noqa: E731
        args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.1)
        fixed = mod.paged_attention_varlen(q, kc, vc, *args)
        generic = mod.paged_attention_varlen(pad(q), pad(kc).contiguous(), pad(vc).contiguous(), *args)
        assert torch.equal(fixed, generic[..., :d]), (d, group)


@pytest.mark.parametrize("group,head_dim", [(1, 64), (3, 64), (8, 64), (2, 128), (5, 128)])
def test_bf16_routine_is_as_close_to_float32_as_rounding_allows(group, head_dim, isa_kernels):
    """A bf16 cache with head_dim 64/128 runs on bf16 dot products (probabilities rounded
    to bf16 for the weighted sum of V). Its error against float32 attention over the same
    numbers must stay within a few bf16 roundings of the output, close to what rounding the
    float32 kernel's own output costs, and prompt tokens must give a decode's bits."""
    mod = isa_kernels
    q, kc, vc, meta = make_case(torch.bfloat16, num_kv_heads=2, group=group, head_dim=head_dim, seed=group)
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, head_dim ** -0.5)
    got = mod.paged_attention_varlen(q, kc, vc, *args).float()
    ref = dense_reference(q.float(), kc.float(), vc.float(), meta, head_dim ** -0.5)
    rounded = mod.paged_attention_varlen(q.float(), kc.float(), vc.float(), *args).bfloat16().float()
    err, floor = (got - ref).abs(), (rounded - ref).abs()
    assert err.max() <= 4 * floor.max() + 1e-3, (err.max(), floor.max())
    assert err.mean() <= 2 * floor.mean(), (err.mean(), floor.mean())
    # The last sequence's 100 tokens as one prompt chunk: each token's output is the bits
    # its decode step gives.
    n = int(meta.seq_lens[-1])
    qp = torch.randn(n, q.shape[1], head_dim, generator=torch.Generator().manual_seed(1)).bfloat16()
    table = meta.block_tables[-1:]
    chunk = mod.paged_attention_varlen(qp, kc, vc, table, torch.tensor([0, n]), torch.tensor([n]), head_dim ** -0.5)
    for i in (0, 15, 16, 57, n - 1):
        one = mod.paged_attention_varlen(qp[i:i + 1], kc, vc, table, torch.tensor([0, 1]), torch.tensor([i + 1]),
                                         head_dim ** -0.5)
        assert torch.equal(one[0], chunk[i]), i


def windowed_reference(q, k_cache, v_cache, tables, lens, scale, window):
    """Dense attention of each row over its last `window` keys, in float64."""
    hkv, _, _, d = k_cache.shape
    out = []
    for i, n in enumerate(lens.tolist()):
        s = max(0, n - window)
        k = k_cache[:, tables[i]].reshape(hkv, -1, d)[:, s:n].double()
        v = v_cache[:, tables[i]].reshape(hkv, -1, d)[:, s:n].double()
        p = torch.softmax(q[i].double().view(hkv, -1, d) @ k.transpose(-1, -2) * scale, dim=-1)
        out.append((p @ v).reshape(-1, d))
    return torch.stack(out)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window", [1, 7, 16, 50])
def test_sliding_window_kernel_and_torch_path_match_dense(dtype, tol, window, isa_kernels):
    """A sliding-window layer's attention (Gemma 3's local layers): the flat kernel and
    torch's masked matmuls each see only a row's last `window` keys; a window past the
    context is plain attention."""
    q, kc, vc, meta = make_case(dtype, num_kv_heads=2, group=2, head_dim=64, seed=window)
    ref = windowed_reference(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, window)
    args = (meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125)
    flat = isa_kernels.paged_attention_varlen(q, kc, vc, *args, window=window)
    torch.testing.assert_close(flat.double(), ref, atol=tol, rtol=tol)
    torch.testing.assert_close(paged_attention(q, kc, vc, meta, 0.125, window).double(), ref, atol=tol, rtol=tol)
    assert torch.equal(isa_kernels.paged_attention_varlen(q, kc, vc, *args, window=1000),
                       isa_kernels.paged_attention_varlen(q, kc, vc, *args))


def test_sliding_window_prompt_chunk_gives_each_tokens_decode_bits(isa_kernels):
    """With a window, a token's output is the same bits in a prompt chunk of any size as in
    its own decode step (deterministic mode's batch invariance), and matches dense attention."""
    mod = isa_kernels
    for dtype in (torch.float32, torch.bfloat16):
        q, kc, vc, meta = make_case(dtype, num_kv_heads=1, group=4, head_dim=256 // 4, seed=3)
        n, window = int(meta.seq_lens[-1]), 24
        qp = torch.randn(n, q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(2)).to(dtype)
        table = meta.block_tables[-1:]
        chunk = mod.paged_attention_varlen(qp, kc, vc, table, torch.tensor([0, n]), torch.tensor([n]), 0.1,
                                           window=window)
        for i in (0, 10, 23, 24, 25, 57, n - 1):
            one = mod.paged_attention_varlen(qp[i:i + 1], kc, vc, table, torch.tensor([0, 1]), torch.tensor([i + 1]),
                                             0.1, window=window)
            assert torch.equal(one[0], chunk[i]), (dtype, i)
            ref = windowed_reference(qp[i:i + 1], kc, vc, table, torch.tensor([i + 1]), 0.1, window)
            torch.testing.assert_close(one.double(), ref, atol=2e-2, rtol=2e-2)
