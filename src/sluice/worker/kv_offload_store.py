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
        if compress and not k.dtype.is_floating_point:
            raise ValueError("int8 offload compresses a floating-point KV cache; an int8 cache is kept exact")
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

    # -- one block's bytes ----------------------------------------------------------
    def _rows(self, buf: torch.Tensor) -> torch.Tensor:
        """A block's bytes viewed [slots, 2 (K, V), heads, block_size, row] in its form."""
        n = len(self.kv)
        if self.compress:
            return buf.view(n, 2, self.heads, self.block_size, self.row + 4)
        return buf.view(self.cache_dtype).view(n, 2, self.heads, self.block_size, self.row)

    def _gather(self, block_id: int) -> torch.Tensor:
        """[slots, 2, heads, block_size, row] of the pool block, on the cache's device."""
        return torch.stack([torch.stack((k[:, block_id], v[:, block_id])) for k, v in self.kv])

    def _encode(self, values: torch.Tensor) -> torch.Tensor:
        """The block's values in the stored form, as bytes [block_bytes] on their device."""
        if not self.compress:
            return values.contiguous().view(torch.uint8).reshape(-1)
        q, scale = quantize_rows_int8(values)
        return torch.cat([scale.contiguous().view(torch.uint8).reshape(*scale.shape, 4), q.view(torch.uint8)],
                         dim=-1).reshape(-1)

    def _decode_into(self, data: torch.Tensor, block_id: int) -> None:
        """Stored bytes (on the cache's device) -> the pool block's K and V."""
        rows = self._rows(data)
        if self.compress:
            scale = rows[..., :4].contiguous().view(torch.float32)
            values = (rows[..., 4:].view(torch.int8).float() * scale).to(self.cache_dtype)
        else:
            values = rows
        for j, (k, v) in enumerate(self.kv):
            k[:, block_id].copy_(values[j, 0])
            v[:, block_id].copy_(values[j, 1])

    # -- the transfers ------------------------------------------------------------------
    def execute(self, transfers: list[tuple[str, int, int, bytes]],
                kv_tensors: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[str, bytes, int]]:
        """Do the copies in order; returns the reloads that failed as (kind, key, block id)
        (their blocks hold garbage: the scheduler recomputes them)."""
        self.kv = kv_tensors
        failed = []
        for kind, src, dst, key in transfers:
            t0 = time.perf_counter()
            if kind == "save":
                self.host[dst].copy_(self._encode(self._gather(src)))
            elif kind == "load":
                self._decode_into(self.host[src].to(self.device, non_blocking=True), dst)
            elif kind == "spill":
                self._spill(src, dst)
            elif kind == "load_disk":
                data = self._read_disk(src)
                if data is None:
                    failed.append((kind, key, dst))
                    continue
                self._decode_into(data.to(self.device), dst)
            else:
                raise ValueError(f"unknown KV transfer {kind!r}")
            entry = self.timings.setdefault(kind, [0.0, 0])
            entry[0] += time.perf_counter() - t0
            entry[1] += 1
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
