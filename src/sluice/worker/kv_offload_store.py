"""OffloadStore: the bytes of the KV tiers below the block pool, and the copies between
them and the runner's KV tensors (the OffloadIndex in core/kv_offload.py decides them).

A block here is what a pool block holds: K and V of the layout's `group_size` tensor
slots, [kv_heads, block_size, row] each. Two forms:
  exact  the cache's own bytes (bf16, float32, or the int8 cache's bytes as they are):
         a reloaded block holds the very bits the pool held (deterministic mode's form)
  int8   a bf16/float16/float32 cache compressed per row (one kv head, one token): a
         float32 scale and int8 values, the int8 KV cache's rounding (backends/kv_int8.py).
         2 * (D + 4) bytes a row instead of 2 * 2 * D for bf16: ~1.9x the blocks per GiB.
The host tier is one uint8 tensor [slots, block bytes] in host memory (pinned where the
cache is on a GPU). The disk tier is one file of slots in --kv-offload-dir (unlinked
once open, so it goes with the process however that ends), written and
read with pwrite/pread rather than a memory map: a full disk is then an OSError the
store can answer (degrade to recompute, one warning), where a write into a mapped page
beyond the disk's room is a SIGBUS that ends the process. Each disk slot's CRC32 is kept
in memory and checked on every read, so a file changed under us is detected and its
blocks dropped, never read as K/V.
"""
from __future__ import annotations

import logging
import os
import time
import zlib

import torch

from sluice.backends.kv_int8 import quantize_rows_int8

logger = logging.getLogger(__name__)

# Blocks copied per batch: a long history's reload as one batch made float32 temporaries
# of ~0.7 MiB a block (an int8 block decoded), hundreds of MiB for a 7k-token history.
MAX_BATCH = 32


def offload_compresses(mode: str, cache_dtype: torch.dtype, deterministic: bool) -> bool:
    """Whether offloaded blocks take the int8 form: asked for, or "auto" for a 16-bit
    floating-point cache outside deterministic mode (float32 caches are the exact-match
    runs', int8 caches are int8 already)."""
    if mode == "int8":
        return True
    return mode == "auto" and cache_dtype in (torch.bfloat16, torch.float16) and not deterministic


def offload_block_bytes(kv_tensors: list[tuple[torch.Tensor, torch.Tensor]], compress: bool) -> int:
    """Bytes of one offloaded block for these KV tensors, in either form."""
    k = kv_tensors[0][0]
    heads, _, bs, row = k.shape
    per_row = (row + 4) if compress else row * k.element_size()
    return 2 * len(kv_tensors) * heads * bs * per_row


class OffloadStore:
    def __init__(self, kv_tensors: list[tuple[torch.Tensor, torch.Tensor]], host_blocks: int, compress: bool,
                 disk_dir: str | None = None, disk_blocks: int = 0):
        # The runner's K/V tensors, of the shape and dtype kv_tensors has (execute() is
        # given the current ones: sleep and wake_up make new tensors).
        self.kv = kv_tensors
        k = kv_tensors[0][0]
        self.device = k.device
        self.cache_dtype = k.dtype
        self.heads, _, self.block_size, self.row = k.shape
        if compress and k.dtype.itemsize == 1:
            raise ValueError("int8 offload compresses a 16- or 32-bit KV cache; an int8 or FP8 cache is kept exact")
        self.compress = compress
        self.block_bytes = offload_block_bytes(kv_tensors, compress)
        self.host = torch.empty((host_blocks, self.block_bytes), dtype=torch.uint8,
                                pin_memory=self.device.type == "cuda")
        self.fd: int | None = None
        self.path: str | None = None
        self.crc: list[int | None] = []
        self.disk_ok = disk_blocks > 0 and disk_dir is not None
        if self.disk_ok:
            try:
                os.makedirs(disk_dir, exist_ok=True)
                self.path = os.path.join(disk_dir, f"sluice-kv-{os.getpid()}-{id(self):x}.bin")
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
                # Unlinked at once: the file lives while the process holds it open, and a
                # crashed server leaves no gigabytes behind.
                os.unlink(self.path)
                self.crc = [None] * disk_blocks
            except OSError as e:
                self._disk_failed(e)
        # Per kind of copy: seconds and blocks since the last take_timings().
        self.timings: dict[str, list[float]] = {}

    # -- blocks' bytes ------------------------------------------------------------------
    def _gather(self, block_ids: torch.Tensor) -> torch.Tensor:
        """[n, slots, 2 (K, V), heads, block_size, row] of these pool blocks, on the cache's device."""
        per_slot = [torch.stack((k.index_select(1, block_ids), v.index_select(1, block_ids))) for k, v in self.kv]
        return torch.stack(per_slot).permute(3, 0, 1, 2, 4, 5)

    def _encode(self, values: torch.Tensor) -> torch.Tensor:
        """Blocks' values -> their stored form, [n, block_bytes] uint8 on their device."""
        n = values.shape[0]
        if not self.compress:
            return values.contiguous().view(torch.uint8).reshape(n, -1)
        q, scale = quantize_rows_int8(values)
        return torch.cat([scale.unsqueeze(-1).contiguous().view(torch.uint8), q.view(torch.uint8)],
                         dim=-1).reshape(n, -1)

    def _scatter(self, data: torch.Tensor, block_ids: torch.Tensor) -> None:
        """Stored bytes [n, block_bytes] (on the cache's device) -> the pool blocks' K and V."""
        n = data.shape[0]
        if self.compress:
            rows = data.view(n, len(self.kv), 2, self.heads, self.block_size, self.row + 4)
            scale = rows[..., :4].contiguous().view(torch.float32)
            values = (rows[..., 4:].view(torch.int8).float() * scale).to(self.cache_dtype)
        else:
            values = data.view(self.cache_dtype).view(n, len(self.kv), 2, self.heads, self.block_size, self.row)
        values = values.permute(1, 2, 3, 0, 4, 5)  # [slots, 2, heads, n, block_size, row]
        for j, (k, v) in enumerate(self.kv):
            if k.dtype.itemsize == 1:  # int8 and FP8 caches: their bytes (torch has no fp8 index_copy_)
                k, v, vals = k.view(torch.uint8), v.view(torch.uint8), values[j].view(torch.uint8)
            else:
                vals = values[j]
            k.index_copy_(1, block_ids, vals[0])
            v.index_copy_(1, block_ids, vals[1])

    # -- the transfers ------------------------------------------------------------------
    def execute(self, transfers: list[tuple[str, int, int, bytes]],
                kv_tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[str, bytes, int]]:
        """Do the copies in order; returns the reloads that failed as (kind, key, block id)
        (their blocks hold garbage: the scheduler recomputes them). A run of saves, or of
        loads, goes in batches of up to MAX_BATCH, each ending before a copy that writes a
        slot or block the batch already writes (within a batch, order does not matter)."""
        self.kv = kv_tensors
        failed = []
        i = 0
        while i < len(transfers):
            kind = transfers[i][0]
            j = i + 1
            if kind in ("save", "load"):
                written = {transfers[i][2]}
                while (j < len(transfers) and j - i < MAX_BATCH and transfers[j][0] == kind
                       and transfers[j][2] not in written):
                    written.add(transfers[j][2])
                    j += 1
            run = transfers[i:j]
            t0 = time.perf_counter()
            if kind == "save":
                blocks = torch.tensor([t[1] for t in run], device=self.device)
                slots = torch.tensor([t[2] for t in run])
                data = self._encode(self._gather(blocks))
                self.host.index_copy_(0, slots, data.to("cpu"))
            elif kind == "load":
                slots = torch.tensor([t[1] for t in run])
                blocks = torch.tensor([t[2] for t in run], device=self.device)
                self._scatter(self.host.index_select(0, slots).to(self.device, non_blocking=True), blocks)
            elif kind == "spill":
                self._spill(run[0][1], run[0][2])
            elif kind == "load_disk":
                _, src, dst, key = run[0]
                data = self._read_disk(src)
                if data is None:
                    failed.append((kind, key, dst))
                else:
                    self._scatter(data.view(1, -1).to(self.device), torch.tensor([dst], device=self.device))
            else:
                raise ValueError(f"unknown KV transfer {kind!r}")
            entry = self.timings.setdefault(kind, [0.0, 0])
            entry[0] += time.perf_counter() - t0
            entry[1] += len(run)
            i = j
        return failed

    def take_timings(self) -> dict[str, list[float]]:
        out, self.timings = self.timings, {}
        return out

    def _spill(self, slot: int, dslot: int) -> None:
        if self.fd is None:
            return  # the disk tier failed earlier: the index drops it (and reloads find nothing)
        data = self.host[slot].numpy()
        try:
            written = os.pwrite(self.fd, memoryview(data), dslot * self.block_bytes)
            if written != self.block_bytes:
                raise OSError(f"short write ({written} of {self.block_bytes} bytes)")
            self.crc[dslot] = zlib.crc32(data)
        except OSError as e:
            self.crc[dslot] = None
            self._disk_failed(e)

    def _read_disk(self, dslot: int) -> torch.Tensor | None:
        """A disk slot's bytes, None where they cannot be read or fail their checksum."""
        if self.fd is None or self.crc[dslot] is None:
            return None
        try:
            data = os.pread(self.fd, self.block_bytes, dslot * self.block_bytes)
        except OSError as e:
            logger.warning("KV offload: reading %s failed (%s); its block is recomputed", self.path, e)
            return None
        if len(data) != self.block_bytes or zlib.crc32(data) != self.crc[dslot]:
            logger.warning("KV offload: a block in %s fails its checksum; it is dropped and recomputed", self.path)
            self.crc[dslot] = None
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _disk_failed(self, error: OSError) -> None:
        if self.disk_ok:
            logger.warning("KV offload: the disk tier cannot be written (%s); blocks past the host tier are "
                           "recomputed from now on", error)
        self.disk_ok = False
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = None
