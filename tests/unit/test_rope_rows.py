"""RopeRows: a CPU step's cos/sin gathered from rows computed once are the bits computing
them for the step gives, the table grows with the positions asked for, and a position
beyond its cap (or a tensor off the CPU) gets None, so the step computes its own."""
import random

import pytest
import torch

from sluice.models.llama import LlamaArch, RopeRows, rope_attention_factor, rope_cos_sin, rope_inv_freq


def arch(**changes) -> LlamaArch:
    base = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2, num_kv_heads=1,
                head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=8192,
                tie_word_embeddings=True, qkv_bias=False, o_bias=False, qk_norm=False)
    return LlamaArch(**{**base, **changes})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 512}])
def test_rows_are_the_bits_of_each_step(dtype, scaling):
    a = arch(rope_scaling=scaling)
    inv_freq, factor = rope_inv_freq(a), rope_attention_factor(a)
    rows, rng = RopeRows(), random.Random(0)
    for step in range(60):
        # Decode steps, prompt chunks and mixed batches; later steps reach past 1,024.
        n = rng.choice([1, 2, 7, 16, 33, 100])
        top = 900 if step < 30 else 5000
        positions = torch.tensor([rng.randrange(top) for _ in range(n)])
        table = rows.rows(positions, dtype, inv_freq, factor)
        assert table is not None and table[0].shape[0] >= int(positions.max()) + 1
        got = rope_cos_sin(positions, dtype, inv_freq, table, factor)
        want = rope_cos_sin(positions, dtype, inv_freq, None, factor)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w)
    assert rows.table[0].shape[0] == 8192  # grown by doubling from 1,024


def test_the_table_is_capped_and_stays_on_the_cpu():
    inv_freq = rope_inv_freq(arch())
    rows = RopeRows(max_bytes=4096 * 64 * 2)  # 4,096 rows of 64 bf16 values a table
    assert rows.rows(torch.tensor([10]), torch.bfloat16, inv_freq)[0].shape == (1024, 64)
    assert rows.rows(torch.tensor([4095]), torch.bfloat16, inv_freq)[0].shape == (4096, 64)
    assert rows.rows(torch.tensor([3, 4096]), torch.bfloat16, inv_freq) is None  # past the cap
    assert rows.rows(torch.tensor([4096]), torch.float32, inv_freq) is None  # 4-byte rows: 2,048 of them
    assert rows.rows(torch.tensor([], dtype=torch.long), torch.bfloat16, inv_freq) is None
    assert rows.rows(torch.tensor([3], device="meta"), torch.bfloat16, inv_freq) is None


def test_another_inv_freq_or_dtype_builds_its_own_rows():
    rows = RopeRows()
    positions = torch.tensor([0, 5, 700])
    a, b = rope_inv_freq(arch()), rope_inv_freq(arch(rope_theta=500000.0))
    for inv_freq, dtype in ((a, torch.bfloat16), (b, torch.bfloat16), (b, torch.float32),
                            (a.bfloat16(), torch.float32)):  # (a model moved to bf16 has a bf16 inv_freq)
        table = rows.rows(positions, dtype, inv_freq)
        assert table[0].dtype == dtype
        got, want = rope_cos_sin(positions, dtype, inv_freq, table), rope_cos_sin(positions, dtype, inv_freq, None)
        assert all(torch.equal(g, w) for g, w in zip(got, want))
