"""The backend interface: one object per device family answers, for one engine, every
"which implementation runs" question, and the model, the runner and the engine only ask.

`backends/select.py` picks the family from the device (cpu: backends/cpu/, cuda:
backends/cuda/) and builds its Backend from the settings, once, before any weight is
loaded; a mode the family cannot run is refused there in one line. A Backend owns:

- the plan line (`line()`), logged at start and asserted by the tests;
- the model's set-up (`prepare`, and `update` after a weight update): each Linear's method
  for the quantization scheme (quantization/), the layer ops the model calls (`ops`:
  RMSNorm, SwiGLU, RoPE with the K/V write, attention), the LM head and its fast paths;
- the KV cache: its bytes per block and its tensors (`allocate_kv_cache`);
- each step's attention record (`attention_metadata`, from the flat batch's host lists);
- the sampler's device ops (`sampler_ops`) and the greedy head (`greedy_tokens`);
- on a GPU, graph capture (`capture`, `run_graph`);
- the LoRA deltas' kernel (`lora_kernel`).

Adding a device family is one folder under backends/ with its Backend subclass and its
kernels, and one entry in select.py's FAMILIES; models/, the runner and the engine do not
change.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sluice.core.kv_layout import KVLayout
from sluice.worker.shapes import bucket


@dataclass
class PrefillChunk:
    """A prompt chunk that attention computes on its own (the torch path's SDPA call)."""
    token_start: int        # rows [token_start, token_end) of the flat batch
    token_end: int
    start_pos: int          # tokens of this request already in the cache
    seq_len: int            # context length after this step
    block_ids: torch.Tensor  # [num_blocks]
    mask: torch.Tensor | None  # [q, seq_len] bool, None when plain causal from 0


@dataclass
class AttentionMetadata:
    """One step's attention record, built by the backend from the flat batch and passed to
    the model explicitly (no hidden global context). The first fields are every backend's;
    the rest belong to the implementation that reads them."""
    slot_mapping: torch.Tensor          # [T] cache slot of each new token (padding rows: a scratch slot)
    query_start_loc: torch.Tensor       # [B+1] offsets of each request in the flat batch
    seq_lens: torch.Tensor              # [B] context length of each request after this step
    block_tables: torch.Tensor          # [B, max_blocks], padded with 0
    # The torch path (backends/torch_ref.py): decodes (one query token each) batched, and
    # one record per prompt chunk.
    decode_token_idx: torch.Tensor | None = None   # [Bd] rows of the flat batch
    decode_block_tables: torch.Tensor | None = None  # [Bd, blocks]
    decode_mask: torch.Tensor | None = None        # [1, Bd, 1, blocks * block_size] bool, True = attend
    decode_seq_lens: torch.Tensor | None = None    # [Bd]
    prefills: list[PrefillChunk] = field(default_factory=list)
    # The CPU kernels: the module whose paged_attention_varlen computes every token of the
    # step in one call (then the decoder stack may run the step), and the decode kernel
    # the torch path uses for decode rows where it is built.
    flat_kernel: object | None = None
    decode_kernel: object | None = None
    # A backend's own per-step record (the CUDA backend's tiles and split plan).
    extra: object | None = None
    # Where the KV layout has several groups (core/kv_layout.py), each layer's record: its
    # group's block tables and slots (the rest is the step's); None: this record serves all.
    layer_meta: list | None = None

    def for_layer(self, i: int) -> "AttentionMetadata":
        """The record layer i attends with."""
        return self if self.layer_meta is None else self.layer_meta[i]


@dataclass
class FlatBatch:
    """What the runner knows of a step's flat batch, on the host: per request its rows
    [query_start[i], query_start[i + 1]) (the last of its tokens: the first sits at
    position seq_lens[i] minus its row count), its context length after the step and its
    block ids; per row its cache slot (padding rows of a bucketed batch: the scratch slot)."""
    query_start: list[int]
    seq_lens: list[int]
    block_ids: list[list[int]]
    slots: list[int]
    block_size: int


class Backend:
    """The interface (and what every family shares). Subclasses: backends/cpu/backend.py,
    backends/cuda/backend.py."""
    family = "?"
    # Every backend has these (a dataclass subclass declares them as its fields).
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: str                 # "auto" (the model's dtype) or "int8"
    deterministic: bool
    tensor_parallel_size: int
    # The layer ops the model calls (RMSNorm, SwiGLU, RoPE + K/V write, attention), set on
    # its modules by prepare().
    ops = None
    # The step budget where the settings name none (tokens a step).
    default_max_num_batched_tokens = 2048
    # Whether planning step N while step N - 1 runs pays by default (asynchronous
    # scheduling): where the device computes while the host plans, yes; where the host is
    # the device (a CPU), a step has finished when launch returns and nothing overlaps.
    overlap_pays = False
    # Whether sliding-window layers get block tables of their own, giving blocks behind the
    # window back to the pool (core/kv_layout.py); else every layer shares one table.
    hybrid_kv = True

    @classmethod
    def auto_quantization(cls, model_config, tensor_parallel_size: int) -> str | None:
        """quantization='auto' resolved: the scheme that runs the checkpoint's quantized
        weights in their own form on this family, or None (full precision)."""
        return None

    # -- chosen before anything loads ----------------------------------------------
    @classmethod
    def auto_dtype_for(cls, device: str, cpu_isa: str = "auto") -> torch.dtype:
        """What dtype='auto' means on this family (for this device and settings)."""
        raise NotImplementedError

    @classmethod
    def check_settings(cls, model_config, cache_config, tensor_parallel_size: int) -> None:
        """One-line ValueErrors for settings this family cannot run here; builds nothing."""
        raise NotImplementedError

    @classmethod
    def build(cls, model_config, cache_config, dtype: torch.dtype | None, tensor_parallel_size: int = 1
              ) -> "Backend":
        """The backend for these settings (dtype None: 'auto'), its kernels loaded."""
        raise NotImplementedError

    def line(self) -> str:
        raise NotImplementedError

    # -- the model --------------------------------------------------------------
    def check_model(self, arch) -> None:
        """ValueError for a model this backend's mode cannot run (before its weights load)."""

    def prepare(self, model, quantization: str | None, max_positions: int | None, with_head: bool = True) -> None:
        raise NotImplementedError

    def update(self, model, quantization: str | None, written: dict, with_head: bool = True) -> None:
        raise NotImplementedError

    # -- the KV cache -------------------------------------------------------------
    def kv_layout(self, arch) -> KVLayout:
        """How the model's layers share the KV pool: groups by sliding window where this
        backend gives them tables of their own, else one group of all layers."""
        if self.hybrid_kv:
            return KVLayout.for_windows(arch.num_layers, getattr(arch, "layer_windows", ()))
        return KVLayout.plain(arch.num_layers)

    def kv_row_bytes(self, arch) -> int:
        """Bytes of one token's K (or V) for one KV head in the cache."""
        return arch.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def kv_bytes_per_block(self, arch, block_size: int, num_kv_heads: int | None = None) -> int:
        """Bytes of one KV block (the K/V of one layout group's layers; all layers where
        the layout has one group) for `num_kv_heads` (default the model's)."""
        heads = num_kv_heads or arch.num_kv_heads
        return 2 * self.kv_layout(arch).group_size * block_size * heads * self.kv_row_bytes(arch)

    def num_kv_blocks(self, cache, arch, num_kv_heads: int | None = None) -> int:
        """The cache's block count: as the settings give it, else as many as
        `kv_cache_memory` GiB hold."""
        per_block = self.kv_bytes_per_block(arch, cache.block_size, num_kv_heads)
        return cache.num_blocks or max(1, int(cache.kv_cache_memory * 2**30) // per_block)

    def allocate_kv_cache(self, num_layers: int, num_kv_heads: int, num_blocks: int, block_size: int,
                          head_dim: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """K and V per tensor slot (a layer, or one layer of each layout group), [kv_heads,
        num_blocks + 1, block_size, head_dim] zeros: one block past the pool, where padding
        rows of a bucketed batch write their K/V."""
        shape = (num_kv_heads, num_blocks + 1, block_size, head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(num_layers)]

    # -- one step -----------------------------------------------------------------
    def padded_rows(self, n: int) -> int:
        """The rows a step of n tokens (or an LM-head call of n rows) runs as: one of a few
        sizes (worker/shapes.py), where ops build a kernel per shape (CUDA graphs, oneDNN's
        linear layers); the padding rows compute nothing anyone reads."""
        return bucket(n)

    def to_device(self, data: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        """A step's host list as a tensor on the device (the runner's ids, positions, rows)."""
        return torch.tensor(data, dtype=dtype, device=self.device)

    def attention_metadata(self, batch: FlatBatch) -> AttentionMetadata:
        raise NotImplementedError

    def group_metadata(self, base: AttentionMetadata, batch: FlatBatch) -> AttentionMetadata:
        """The record of another layout group's layers for the step `base` was made for:
        the same rows and lengths, `batch`'s block tables and slots."""
        return self.attention_metadata(batch)

    def greedy_tokens(self, model, hidden: torch.Tensor, grammar=None) -> torch.Tensor | None:
        """The argmax of the LM head per row where this backend has a faster way to it than
        the logits; None: compute the logits."""
        return None

    def sampler_ops(self) -> tuple:
        """(argmax over rows, apply a token bitmask in place, sample rows: worker/sampler.py's
        Sampler arguments), or None each for torch's."""
        return None, None, None

    def capture(self, runner) -> None:
        """Record what runs the same way every step (CUDA graphs), once the runner's KV
        tensors exist; nothing by default."""

    def release(self) -> None:
        """Forget what capture() recorded (the KV tensors it read are being freed)."""

    def forward(self, model, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches) -> torch.Tensor:
        """The model's forward pass over one step (a recorded graph's replay where capture()
        made one for the step's shape)."""
        return model(input_ids, positions, meta, kv_caches)

    def synchronize(self) -> None:
        """Wait for the device's queued work (timings); nothing where work is synchronous."""

    def lora_kernel(self):
        """The op that adds a step's LoRA deltas in one call per layer, each row through its
        own adapter (lora/slots.py; `lora_sgmv(y, x, at, bt, ranks, row_slot)`), or None:
        torch's matmuls per adapter's group of rows."""
        return None


def weight_bytes(model) -> int:
    """Bytes of the distinct tensors a prepared model computes with: its parameters and
    buffers (none for a weight a quantization scheme released) and what the backend's
    methods on its modules hold (packed weights, scales, a head's copy), each storage
    counted once. What "memory after load" means for the weights (the KV cache apart)."""
    import dataclasses
    import types

    storages: dict[int, int] = {}

    def add(t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        if t.layout != torch.strided:  # oneDNN's prepacked weights: opaque, no storage to share
            storages[id(t)] = t.numel() * t.element_size()
            return
        s = t.untyped_storage()
        storages[s.data_ptr()] = max(storages.get(s.data_ptr(), 0), s.nbytes())

    def walk(obj, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            add(obj)
        elif depth > 3 or obj is None or isinstance(obj, (types.ModuleType, torch.nn.Module, type)):
            return
        elif dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), depth + 1)
        elif isinstance(obj, (tuple, list)):
            for x in obj:
                walk(x, depth + 1)
        elif hasattr(obj, "__dict__"):
            for x in vars(obj).values():
                walk(x, depth + 1)

    for t in [*model.parameters(), *model.buffers()]:
        add(t)
    for module in model.modules():
        for name, value in vars(module).items():
            if not name.startswith("_"):
                walk(value, 0)
    return sum(storages.values())
