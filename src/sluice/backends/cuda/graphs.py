"""CUDA graphs for decode-only steps: the whole forward pass (embedding, every layer's
matmuls and Triton kernels, the final norm) recorded once per batch size and replayed, so
a decode step costs one launch instead of a few hundred (at one row on an 8B model the
matmuls alone are 4.5 ms: the launches would be a good part of a step).

A decode-only step's shape is fixed by its row count, which the runner pads to a few sizes
(worker/shapes.bucket): one graph per size up to the most rows a step can decode, captured
at start (sizes largest first, all in one memory pool) and logged with their memory. A
replay copies the step's inputs into the graph's static buffers: token ids, positions,
slots, context lengths and block tables; rows past the step's requests (padding) get a
context length of 0 and write their K/V to the scratch slot. Attention inside a graph is
always the split-K decode kernel with a split count fixed by the longest context the
engine allows (a short context leaves the later splits empty), since a graph cannot
choose its launch grid per step. Steps with prompt chunks or drafts run eagerly.
"""
from __future__ import annotations

import logging

import torch

from sluice.backends.base import AttentionMetadata
from sluice.worker.shapes import bucket

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_rows: int, max_model_len: int, block_size: int, scratch_slot: int,
                 splits: int, device: torch.device):
        self.model, self.kv_caches = model, kv_caches
        self.max_rows = bucket(max_rows)
        self.splits = splits
        self.split_len = -(-max_model_len // splits)
        self.scratch_slot = scratch_slot
        n, width = self.max_rows, -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def sizes(self) -> list[int]:
        return sorted({bucket(i) for i in range(1, self.max_rows + 1)})

    def _meta(self, n: int) -> AttentionMetadata:
        from sluice.backends.cuda.backend import CudaAttentionPlan
        plan = CudaAttentionPlan(None, None, None, None, 1, splits=self.splits, split_len=self.split_len,
                                 decode_only=True)
        return AttentionMetadata(slot_mapping=self.slot_mapping[:n], query_start_loc=self.query_start[:n + 1],
                                 seq_lens=self.seq_lens[:n], block_tables=self.block_tables[:n], extra=plan)

    @torch.inference_mode()
    def capture(self) -> None:
        before = torch.cuda.memory_allocated()
        stream = torch.cuda.Stream()
        for n in sorted(self.sizes(), reverse=True):
            meta = self._meta(n)
            args = (self.input_ids[:n], self.positions[:n], meta, self.kv_caches)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph (Triton's first launches, cuBLAS handles)
                for _ in range(2):
                    self.model(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.model(*args)
            self.pool = graph.pool()
            self.graphs[n] = (graph, out)
        torch.cuda.synchronize()
        logger.info("CUDA graphs: %d decode batch sizes (%s) captured, %.0f MiB", len(self.graphs),
                    ",".join(map(str, sorted(self.graphs))), (torch.cuda.memory_allocated() - before) / 2**20)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states from its graph, or None where none fits (the caller
        runs it eagerly)."""
        n = input_ids.shape[0]
        entry = self.graphs.get(n)
        if entry is None:
            return None
        b, width = meta.seq_lens.shape[0], meta.block_tables.shape[1]
        if width > self.block_tables.shape[1]:
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:n].zero_()
        self.block_tables[:b, :width].copy_(meta.block_tables)
        graph, out = entry
        graph.replay()
        return out
