"""OffloadIndex: the KV tiers below the block pool, as the scheduler sees them.

A full block the pool is about to evict (its content named by its hash, nothing holding
it) is offloaded instead of lost: copied to a bounded host tier, and from there, when the
host tier is full, to an optional disk tier. A later request whose prefix the pool no
longer holds but a tier does gets a fresh pool block with the content copied back, not
recomputed (SGLang's HiCache, vLLM's KV offloading). Keys are the pool's own (chain hash
and layout group, kv_cache_manager.group_key), so a tenant's cache salt and an adapter's
id isolate offloaded blocks exactly as they isolate cached ones.

This index decides; it never touches data. Every copy it decides is appended to
`transfers` as (kind, src, dst, key):
    save       pool block src -> host slot dst
    spill      host slot src -> disk slot dst (the host slot is then reused)
    load       host slot src -> pool block dst
    load_disk  disk slot src -> pool block dst
and the runner's OffloadStore (worker/kv_offload_store.py) performs them in this order,
before the forward pass of the step that carries them. Order is the whole contract: a
block's content is final when the step that wrote it has run, which is before any later
step's transfers, and a slot's reuse follows the copy that read it. Plans made while a
step is in flight (asynchronous scheduling) stay correct for the same reason.

Each tier is LRU. A key lives in at most one tier (saving a key found on disk moves it up
to the host). Keys being reloaded by the allocation in progress are locked, so that the
saves that allocation itself causes cannot evict them. A reload is taken only when the
copy is cheaper than recomputing (measured seconds per block of each tier against the
measured prefill seconds per token times the block's tokens).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# Exponential moving average weight of a new measurement (copy and prefill costs).
_EMA = 0.2


@dataclass
class TierStats:
    saved: int = 0        # blocks written to the tier
    hits: int = 0         # blocks reloaded from it
    dropped: int = 0      # blocks it lost (LRU past its bound, or a failed load)
    failed: int = 0       # reloads that failed (a checksum mismatch, an I/O error)


class _Tier:
    def __init__(self, name: str, slots: int):
        self.name = name
        self.slots = slots
        self.lru: OrderedDict[bytes, int] = OrderedDict()   # key -> slot, coldest first
        self.free = list(range(slots - 1, -1, -1))
        self.stats = TierStats()

    def take_slot(self, locked: set) -> tuple[int, bytes | None] | None:
        """A free slot, else the coldest unlocked key's (returned, for the caller to move
        or drop); None if every slot is locked."""
        if self.free:
            return self.free.pop(), None
        victim = next((k for k in self.lru if k not in locked), None)
        if victim is None:
            return None
        return self.lru.pop(victim), victim

    def drop(self, key: bytes) -> None:
        slot = self.lru.pop(key, None)
        if slot is not None:
            self.free.append(slot)


class OffloadIndex:
    def __init__(self, host_blocks: int, disk_blocks: int = 0, block_bytes: int = 0, block_size: int = 16):
        if host_blocks < 1:
            raise ValueError(f"the host KV tier needs at least one block, got {host_blocks}")
        self.host = _Tier("host", host_blocks)
        self.disk = _Tier("disk", disk_blocks) if disk_blocks > 0 else None
        self.block_bytes = block_bytes        # bytes of one offloaded block (either tier)
        self.block_size = block_size
        self.transfers: list[tuple[str, int, int, bytes]] = []
        self.locked: set[bytes] = set()
        # Costs, in seconds: per block copied back from each tier (measured by the store),
        # and per prompt token computed (measured from steps). None until first seen.
        self.load_s: dict[str, float | None] = {"host": None, "disk": None}
        self.prefill_s_per_token: float | None = None
        # Off: every block a tier holds is reloaded, whatever the clock measured (what tests
        # that count reloads need: on a tiny model both costs are a few hundred microseconds).
        self.use_costs = True
        self.reload_seconds = 0.0             # measured time spent copying blocks back
        self.recompute_seconds_saved = 0.0    # what computing the reloaded tokens would have cost

    # -- what the tiers hold ----------------------------------------------------
    def tiers(self):
        return (self.host,) if self.disk is None else (self.host, self.disk)

    def where(self, key: bytes) -> str | None:
        """The tier holding the key if reloading it beats recomputing it, else None."""
        for tier in self.tiers():
            if key in tier.lru:
                return tier.name if self._worth_loading(tier.name) else None
        return None

    def _worth_loading(self, tier: str) -> bool:
        load, prefill = self.load_s[tier], self.prefill_s_per_token
        return not self.use_costs or load is None or prefill is None or load < prefill * self.block_size

    def num_blocks(self, tier: str) -> int:
        t = self.host if tier == "host" else self.disk
        return len(t.lru) if t is not None else 0

    # -- decisions ---------------------------------------------------------------
    def save(self, block_id: int, key: bytes) -> None:
        """The pool evicts block_id, whose content key names: keep it in the host tier."""
        host = self.host
        if key in host.lru:
            host.lru.move_to_end(key)  # the same content is there already
            return
        if self.disk is not None:
            self.disk.drop(key)  # (saved again: the host copy replaces the disk one)
        got = host.take_slot(self.locked)
        if got is None:
            return  # every host slot is being reloaded this step: this block is lost
        slot, victim = got
        if victim is not None:
            self._spill(slot, victim)
        host.lru[key] = slot
        host.stats.saved += 1
        self.transfers.append(("save", block_id, slot, key))

    def _spill(self, slot: int, key: bytes) -> None:
        """The host tier's coldest key leaves its slot: to disk where there is one."""
        disk = self.disk
        got = disk.take_slot(self.locked) if disk is not None else None
        if got is None:
            self.host.stats.dropped += 1
            return
        dslot, victim = got
        if victim is not None:
            disk.stats.dropped += 1
        disk.lru[key] = dslot
        disk.stats.saved += 1
        self.transfers.append(("spill", slot, dslot, key))

    def load(self, key: bytes, block_id: int) -> None:
        """Copy the key's content back into pool block block_id (where() found it)."""
        for tier in self.tiers():
            slot = tier.lru.get(key)
            if slot is not None:
                tier.lru.move_to_end(key)
                tier.stats.hits += 1
                if self.prefill_s_per_token is not None:
                    self.recompute_seconds_saved += self.prefill_s_per_token * self.block_size
                self.transfers.append(("load" if tier is self.host else "load_disk", slot, block_id, key))
                return
        raise KeyError("offloaded block not found")  # where() said it was: a caller's bug

    def failed(self, kind: str, key: bytes) -> None:
        """A reload of key failed (the store found its bytes corrupt or unreadable): it is
        forgotten, and its tokens are recomputed."""
        tier = self.host if kind == "load" else self.disk
        if tier is not None and key in tier.lru:
            tier.drop(key)
            tier.stats.failed += 1
            tier.stats.dropped += 1

    def disable_disk(self) -> None:
        """The disk tier cannot be written (full, or gone): recompute instead from now on."""
        if self.disk is not None:
            self.disk.stats.dropped += len(self.disk.lru)
            self.disk = None

    def take_transfers(self) -> list[tuple[str, int, int, bytes]]:
        out, self.transfers = self.transfers, []
        return out

    def clear(self) -> None:
        """Forget every offloaded block (a weight update: their K/V is stale)."""
        for tier in self.tiers():
            tier.lru.clear()
            tier.free = list(range(tier.slots - 1, -1, -1))

    # -- costs ----------------------------------------------------------------------
    def observe_loads(self, tier: str, seconds: float, blocks: int) -> None:
        if blocks <= 0:
            return
        self.reload_seconds += seconds
        per = seconds / blocks
        old = self.load_s[tier]
        self.load_s[tier] = per if old is None else (1 - _EMA) * old + _EMA * per

    def observe_prefill(self, prompt_tokens: int, seconds: float) -> None:
        """A step that computed prompt_tokens prompt tokens (and little else) took seconds."""
        if prompt_tokens <= 0:
            return
        per = seconds / prompt_tokens
        old = self.prefill_s_per_token
        self.prefill_s_per_token = per if old is None else (1 - _EMA) * old + _EMA * per
