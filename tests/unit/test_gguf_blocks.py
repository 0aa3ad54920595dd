"""A GGUF's own quantized blocks (quantization/gguf_blocks.py) hold exactly the values the
gguf package (ggml's reference) dequantizes to, for every type kept; and the loader hands
them over with the rows in the model's order."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quant_shape_to_byte_shape

from sluice.quantization.gguf_blocks import (BLOCK_TYPES, Q6KBlocks, blocks_of, blocks_values, decode_blocks, decode_q6k,
                                             quantize_8bit_blocks)

# Byte offsets of each type's float16 scale fields within a block.
F16_FIELDS = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Random bytes as a tensor of `name` (every bit pattern of the quantized fields is a
    valid block), with finite float16 scales."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in F16_FIELDS[name]:
        blocks[:, at:at + 2] = rng.uniform(1e-3, 5e-2, len(blocks)).astype(np.float16).view(np.uint8).reshape(-1, 2)
    if name == "Q8_0":
        qs = blocks[:, 2:].view(np.int8)
        qs[qs == -128] = -127  # llama.cpp's Q8_0 never stores -128 (see decode_blocks)
    return raw


@pytest.mark.parametrize("name", BLOCK_TYPES)
def test_blocks_hold_ggml_values_exactly(name):
    rows, k = 6, 512
    raw = random_blocks(name, rows, k)
    qtype = GGMLQuantizationType[name]
    ref = dequantize(raw.reshape(quant_shape_to_byte_shape((rows, k), qtype)), qtype).reshape(rows, k)
    q, d, m = decode_blocks(raw, name, (rows, k))
    assert q.dtype == np.uint8 and q.max() <= 254 and d.shape == m.shape == (rows, k // 32)
    assert torch.equal(blocks_values(*map(torch.from_numpy, (q, d, m))), torch.from_numpy(ref.astype(np.float32)))


def test_types_without_an_exact_block_form_are_not_decoded():
    raw = random_blocks("Q8_0", 2, 64)
    raw.reshape(-1, 34)[0, 2] = 0x80  # a -128
    assert decode_blocks(raw, "Q8_0", (2, 64)) is None
    assert decode_blocks(np.zeros(210, np.uint8), "Q6_K", (1, 256)) is None  # it has its own form


def test_q6k_blocks_hold_ggml_values_exactly():
    rows, k = 6, 512
    raw = random_blocks("Q6_K", rows, k)
    qtype = GGMLQuantizationType.Q6_K
    ref = dequantize(raw.reshape(quant_shape_to_byte_shape((rows, k), qtype)), qtype).reshape(rows, k)
    blocks = Q6KBlocks(*map(torch.from_numpy, decode_q6k(raw, (rows, k))))
    assert blocks.q.max() <= 63 and blocks.sc.shape == (rows, k // 16) and blocks.d.shape == (rows, k // 256)
    assert torch.equal(blocks.values(), torch.from_numpy(ref.astype(np.float32)))
    assert torch.equal(blocks_of(blocks), blocks.values())


def test_8bit_blocks_of_loaded_values():
    w = torch.randn(5, 70) * torch.logspace(-3, 1, 70)
    q, d, m = quantize_8bit_blocks(w)
    assert q.max() <= 254 and d.shape == (5, 3)
    qb = torch.nn.functional.pad(q.float(), (0, 26)).view(5, 3, 32)
    back = (qb * d[..., None] + m[..., None]).view(5, 96)[:, :70]
    err = (back - w).abs().view(5, -1)
    bound = torch.nn.functional.pad(w.abs(), (0, 26)).view(5, 3, 32).amax(-1) / 254
    assert (err <= bound.repeat_interleave(32, 1)[:, :70] * 1.0001).all()


def test_loader_hands_over_the_files_blocks():
    """With blocks, every matrix of a kept type comes as a meta tensor (never dequantized)
    carrying its blocks, in the model's row order (SmolLM2's Q and K rows unpermuted like
    the values): they hold the values a plain load gives."""
    from sluice.models.loader import iter_weights, resolve_model
    src = resolve_model("smollm2-135m")
    kinds = set()
    for (name, tensor), (name2, plain) in zip(iter_weights(src, torch.float32, blocks=True),
                                             iter_weights(src, torch.float32)):
        assert name == name2
        blocks = getattr(tensor, "gguf_blocks", None)
        if plain.dim() != 2:
            assert blocks is None and torch.equal(tensor, plain)
            continue
        assert tensor.device.type == "meta" and tensor.shape == plain.shape, name  # Q4_1 and Q8_0: kept
        kinds.add(name.split(".")[-2])
        assert torch.equal(blocks_values(*blocks), plain), name
    assert {"q_proj", "k_proj", "down_proj", "embed_tokens"} <= kinds


def test_gemma_q4_k_m_blocks_hold_the_files_values():
    """The real K-quant file's types (one layer's Q5_0, Q8_0, Q4_K and Q6_K matrices): exact."""
    from sluice.models.loader import _gguf_array, read_gguf, resolve_model
    meta, tensors, data = read_gguf(resolve_model("gemma3-270m").path)
    seen = set()
    for t in tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        if not t.name.startswith("blk.1.") or len(t.shape) != 2:
            continue
        raw = _gguf_array(data, t)
        if qtype.name == "Q6_K":
            blocks = Q6KBlocks(*map(torch.from_numpy, decode_q6k(raw, t.shape)))
        else:
            blocks = tuple(map(torch.from_numpy, decode_blocks(raw, qtype.name, t.shape)))
        seen.add(qtype.name)
        want = torch.from_numpy(dequantize(raw, qtype).reshape(t.shape).astype(np.float32))
        assert torch.equal(blocks_of(blocks), want), t.name
    assert seen == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}


def test_source_form_keeps_offsets_for_symmetric_rows_and_minimums_otherwise():
    """A fused layer's rows from three tensors: Q5_0 (m = -16 d) and Q8_0 (m = -127 d)
    rows give one -offset per row; a Q4_K part (its own minimums) gives per-block minimums;
    rows the file did not give as blocks are 8-bit blocks of the loaded values."""
    from sluice.models.linear import Linear
    from sluice.quantization.gguf import source_form

    def part(name, rows, seed):
        return tuple(torch.from_numpy(a) for a in decode_blocks(random_blocks(name, rows, 256, seed), name,
                                                                 (rows, 256)))
    layer = Linear(256, 12, bias=False)
    layer.source_blocks = {0: part("Q5_0", 4, 1), 4: part("Q8_0", 4, 2)}
    q, d, m = source_form(layer)  # rows 8..11: from the loaded weight
    assert m.shape == (12,) and m[:4].eq(-16).all() and m[4:].eq(-127).all()
    assert torch.equal(q[:8], torch.cat([layer.source_blocks[0][0], layer.source_blocks[4][0]]))
    assert torch.equal(q[8:], quantize_8bit_blocks(layer.weight.detach()[8:])[0])
    layer.source_blocks[8] = part("Q4_K", 4, 3)
    q, d, m = source_form(layer)
    assert m.shape == (12, 8) and torch.equal(m[8:], layer.source_blocks[8][2])
    assert torch.equal(m[:4], -16 * d[:4])


def test_q6k_rows_run_in_their_own_form_alone_and_as_8bit_blocks_in_a_fused_layer():
    """A layer that is one Q6_K tensor keeps it (q6k_form); a fused layer with a Q6_K part
    (a Q4_K_M file's attn_v beside q and k) takes 8-bit blocks of its exact values."""
    from sluice.models.linear import Linear
    from sluice.quantization.gguf import q6k_form, source_form
    q6 = Q6KBlocks(*map(torch.from_numpy, decode_q6k(random_blocks("Q6_K", 4, 256, 4), (4, 256))))
    alone = Linear(256, 4, bias=False)
    alone.source_blocks = {0: q6}
    assert q6k_form(alone) is q6
    fused = Linear(256, 8, bias=False)
    fused.source_blocks = {0: tuple(torch.from_numpy(a) for a in decode_blocks(random_blocks("Q8_0", 4, 256, 5),
                                                                                "Q8_0", (4, 256))), 4: q6}
    assert q6k_form(fused) is None
    q, d, m = source_form(fused)
    want = quantize_8bit_blocks(q6.values())
    assert torch.equal(q[4:], want[0]) and torch.equal(d[4:], want[1]) and m.shape == (8,)


def test_loader_hands_over_q6k_matrices_in_their_own_form():
    """Gemma's Q4_K_M file: its first Q6_K matrix (layer 0's ffn_down) comes as Q6KBlocks
    holding ggml's values (the loader stops there: no need to read the rest)."""
    from gguf.constants import GGMLQuantizationType as T
    from sluice.models.loader import _gguf_array, iter_weights, read_gguf, resolve_model
    src = resolve_model("gemma3-270m")
    meta, tensors, data = read_gguf(src.path)
    raw = next(_gguf_array(data, t) for t in tensors if t.name == "blk.0.ffn_down.weight")
    want = torch.from_numpy(dequantize(raw, T.Q6_K).reshape(640, 2048).astype(np.float32))
    for name, tensor in iter_weights(src, torch.bfloat16, blocks=True):
        if name == "model.layers.0.mlp.down_proj.weight":
            break
    assert tensor.device.type == "meta" and isinstance(tensor.gguf_blocks, Q6KBlocks)
    assert torch.equal(tensor.gguf_blocks.values(), want)


@pytest.mark.requires("kernels")
def test_gguf_scheme_runs_a_q6k_layer_in_its_own_kernel(isa_kernels):
    """quantization='gguf' packs a layer of one Q6_K tensor for q6k.cpp (6 bits a weight, int8
    scales) and releases its weight; the layer's output is the kernel's on the file's values."""
    from torch import nn
    from sluice.models.linear import Linear
    from sluice.quantization.gguf import GGUF_SCHEME
    q6 = Q6KBlocks(*map(torch.from_numpy, decode_q6k(random_blocks("Q6_K", 40, 512, 6), (40, 512))))
    layer = Linear(512, 40, bias=False)
    layer.source_blocks = {0: q6}
    method = GGUF_SCHEME.kernel_method(isa_kernels, nn.Module(), "down", layer, torch.bfloat16, False)
    assert method.w4m.dtype == torch.int8 and layer.weight.device.type == "meta"
    assert torch.equal(isa_kernels.w4a8_rows(torch.arange(40), method.w4a8, method.w4d, method.w4m, 512,
                                             method.w4nib), q6.values())
    x = torch.randn(3, 512).to(torch.bfloat16)
    y = method(x)
    assert y.shape == (3, 40) and torch.equal(y[1:2], method(x[1:2]))


@pytest.mark.parametrize("name", BLOCK_TYPES + ("Q6_K",))
def test_the_loaders_dequantization_gives_the_gguf_packages_bits(name):
    """models/loader.dequantized (our decoders, whole tensors at once) against gguf's own
    dequantize, bit for bit: negative scales (a zero value keeps their sign there) and a
    Q8_0 -128 (which the block form cannot hold, but d * q can) included."""
    from sluice.models.loader import dequantized
    rows, k = 6, 512
    raw = random_blocks(name, rows, k, seed=3)
    qtype = GGMLQuantizationType[name]
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    for at in F16_FIELDS[name]:  # every other block's scales negative
        scale = blocks[::2, at:at + 2].copy().view(np.float16)
        blocks[::2, at:at + 2] = (-scale).view(np.uint8)
    if name == "Q8_0":
        blocks[0, 2] = 0x80
    shaped = raw.reshape(quant_shape_to_byte_shape((rows, k), qtype))
    want = dequantize(shaped, qtype).reshape(rows, k).astype(np.float32)
    got = dequantized(shaped, qtype, (rows, k))
    assert got.dtype == np.float32 and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (want == 0).any() or name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K")  # zeros were there to check
