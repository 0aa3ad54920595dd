"""One process's model, built: the backend chosen, the model (this rank's shard of it under
tensor parallelism) loaded and prepared, and its runner with the KV cache. The engine
builds one (rank 0), and so does every other tensor-parallel rank's process
(distributed/tp_rank.py): this module is what both import, so neither imports the other."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sluice.backends.select import select as select_backend
from sluice.config import EngineConfig
from sluice.distributed.parallel import SINGLE, TPShard
from sluice.distributed.tensor_parallel import share_weights
from sluice.heap import return_freed_memory
from sluice.models.linear import Linear, allocate_weight, building_weights
from sluice.models.loader import (dummy_weights, gguf_linear_types, gguf_weight_types, iter_weights, load_hf_config,
                                  resolve_model)
from sluice.models.registry import build_model, model_spec
from sluice.quantization.base import weight_read_directly
from sluice.worker.model_runner import ModelRunner


@dataclass
class Shard:
    """One process's model: the backend plan, the model (this rank's shard of it under
    tensor parallelism, else all of it), loaded and prepared, and its runner."""
    config: EngineConfig
    backend: object
    src: object
    hf_config: object
    model: object
    runner: ModelRunner
    max_model_len: int
    rank: int = 0

    def apply_weights(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Write checked checkpoint tensors (check_weights) into the model and rebuild what
        they touch, as a fresh load of them would be (the backend's update)."""
        written = self.model.load_weights(named, strict=False)
        self.backend.update(self.model, self.config.model.quantization, written, with_head=self.rank == 0)
        return_freed_memory()


def allocate_unblocked(model, types: dict[str, str], kind: str, device) -> None:
    """For a model whose Linear layers were built without weights: allocate those that the
    file does not give whole in `kind` blocks (types: its tensors' GGUF types by Hugging
    Face name; a fused layer needs every part in them) and those read directly as tensors
    (an LM head), so that the load writes their values."""
    blocked: dict[str, bool] = {}
    for name, t in types.items():
        slot = model.weight_slot(name)
        if slot is not None:
            blocked[slot.param] = blocked.get(slot.param, True) and t == kind
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.weight.device.type == "meta" and \
                (not blocked.get(f"{name}.weight", False) or weight_read_directly(name)):
            allocate_weight(module, device)


def build_shard(config: EngineConfig, group=None, spec=None) -> Shard:
    """Select the backend, build and load the model (rank group.rank's shard under tensor
    parallelism), prepare it and allocate its KV cache. spec: the model's
    registry.model_spec, which ranks other than 0 are given instead of reading the config
    (their Shard then has no hf_config)."""
    mc = config.model
    size = config.parallel.tensor_parallel_size
    rank = group.rank if group is not None else 0
    # Which implementation runs each op, decided once and logged in one line; kernels are
    # built (first start) and any mode that cannot run refused before weights load.
    backend = select_backend(mc, config.cache, size, log=rank == 0)
    src = resolve_model(mc.model)
    hf_config = load_hf_config(src) if spec is None else None
    spec = spec or model_spec(hf_config)
    types = gguf_weight_types(src)  # a GGUF's tensors (HF names) and their types, from its header; else None
    # Layers whose weights come as the file's blocks are built without them, so they are
    # never allocated in the model dtype: quantization='gguf' on a GGUF (the linear layers
    # and the embedding: a Q4_K_M file loads in about its own size, not its bf16 size), and
    # w4a8 on a Q4_1 GGUF in one process (the linear layers: their Q4_1 blocks are their
    # form; an 8B file loads in ~5 GB, not the 16 GB its bf16 weights would take).
    blocks_load = src.is_gguf and mc.load_format == "auto"
    q4_blocks = blocks_load and mc.quantization == "w4a8" and size == 1 and gguf_linear_types(src) == {"Q4_1"}
    unallocated = (("linear", "embedding") if blocks_load and mc.quantization == "gguf"
                   else ("linear",) if q4_blocks else ())
    with torch.device(backend.device), building_weights(backend.dtype, unallocated):
        model = build_model(spec, TPShard(rank, size, group) if size > 1 else SINGLE).to(backend.dtype)
    if q4_blocks:
        allocate_unblocked(model, types, "Q4_1", backend.device)
    arch = model.arch
    backend.check_model(arch)
    if mc.load_format == "dummy":  # random weights of the model's shape, made on the device
        dummy_weights(model, mc.seed)
    else:
        if types is not None and rank == 0:  # a GGUF lacking tensors fails before its load, not after
            model.check_checkpoint_names(types)
        # Under tensor parallelism rank 0 reads the checkpoint and sends it to the others.
        # quantization='gguf': every matrix's blocks; w4a8 in one process: a Q4_1 file's
        # own (its d and m exactly, not refitted from the bf16 values; tensor parallelism
        # sends the ranks values, not blocks).
        blocks = True if mc.quantization == "gguf" else \
            frozenset({"Q4_1"}) if mc.quantization == "w4a8" and size == 1 else False
        weights = iter_weights(src, backend.dtype, blocks=blocks) if rank == 0 else None
        model.load_weights(share_weights(group, weights) if group is not None else weights)
    model.eval()
    max_model_len = min(mc.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)
    backend.prepare(model, mc.quantization, max_model_len, with_head=rank == 0)
    for module in model.modules():  # blocks no scheme took (w4a8 takes only its linear layers')
        if getattr(module, "source_blocks", None) is not None:
            module.source_blocks = None
    return_freed_memory()  # before the KV cache, so the load's freed pages and the cache never add up
    runner = ModelRunner(model, backend, config.cache, mc.seed, max_num_seqs=config.scheduler.max_num_seqs,
                         max_model_len=max_model_len)
    return_freed_memory()
    return Shard(config, backend, src, hf_config, model, runner, max_model_len, rank)
