"""Broken GGUF files fail at load in one ValueError that says what is wrong, never a
traceback from deep inside a reader, and before any engine is built."""
from __future__ import annotations

import struct

import pytest

from sluice import LLM


def write_truncated(src, dst, size: int):
    with open(src, "rb") as f:
        dst.write_bytes(f.read(size))
    return dst


@pytest.mark.parametrize("size, message", [
    (100_000, "not a readable GGUF file, truncated or corrupt"),      # inside the vocabulary
    (50_000_000, "ends at byte .* the file is truncated"),             # inside the tensor data
    (3, "not a GGUF file"),
])
def test_truncated_gguf_is_one_clear_error(size, message, smollm2_source, tmp_path):
    path = write_truncated(smollm2_source.path, tmp_path / "model.gguf", size)
    with pytest.raises(ValueError, match=message):
        LLM(model=str(path), num_blocks=16)


def test_gguf_whose_metadata_lies_is_one_clear_error(smollm2_source, tmp_path):
    """block_count says 31 layers, the file holds 30: the missing layer is named."""
    data = bytearray(smollm2_source.path.read_bytes())
    key = b"llama.block_count"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    assert struct.unpack_from("<II", data, at) == (4, 30)  # a uint32, 30
    struct.pack_into("<I", data, at + 4, 31)
    path = tmp_path / "lying.gguf"
    path.write_bytes(data)
    with pytest.raises(ValueError, match=r"missing 9 tensor\(s\), e.g. \['model.layers.30"):
        LLM(model=str(path), num_blocks=16)


def test_a_gguf_is_converted_once_wherever_it_lies(smollm2_source, tmp_path):
    """The converted config and tokenizer are cached by the file's header (its metadata and
    tensor table), not its path: the same file in another checkout's virtualenv finds the
    first one's conversion. (A header that differs gets its own: the lying file above
    would load as the 30 layers of the original's config otherwise.)"""
    import shutil
    from sluice.models.loader import gguf_converted, resolve_model
    first = gguf_converted(smollm2_source)
    assert first is not None
    (tmp_path / "other-venv").mkdir()
    copy = tmp_path / "other-venv" / smollm2_source.path.name
    shutil.copyfile(smollm2_source.path, copy)
    assert gguf_converted(resolve_model(str(copy))) == first
