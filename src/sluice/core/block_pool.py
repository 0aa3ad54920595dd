"""BlockPool: fixed-size KV blocks with reference counts, content hashes and an O(1)
LRU free list.

Under a KVLayout with several groups (kv_layout.py) every group draws from this one pool;
a block remembers the group it was last given to, and the pool counts the blocks in use
per group (the plan line's and /metrics' blocks per layer kind).

Blocks are identified by integer ids into the runner's preallocated K/V tensors. A full
block can carry the hash of its content (see kv_cache_manager.block_hash); the pool maps
hash -> block so a later request with the same prefix can take it. A freed block keeps
its hash and contents and waits in a doubly linked list in least-recently-freed order; it
is evicted (hash dropped) only when allocate() needs it, coldest first. Reviving a free
block, taking one and returning one are all O(1). With KV offloading on, `on_evict` is
told of each block evicted with its content's name, before the block is reused (the
offload index copies it to a lower tier, core/kv_offload.py).
"""
from __future__ import annotations


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.group = 0
        self.block_hash: bytes | None = None
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list with sentinels: popleft, append and remove are all O(1)."""

    def __init__(self, blocks: list[KVBlock]):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev = block, last
        block.next, self.tail.prev = self.tail, block
        self.num_free += 1

    def popleft(self) -> KVBlock:
        if self.num_free == 0:
            raise IndexError("no free blocks")
        block = self.head.next
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.num_free -= 1

    def ids(self) -> list[int]:
        out, b = [], self.head.next
        while b is not self.tail:
            out.append(b.block_id)
            b = b.next
        return out


class BlockPool:
    def __init__(self, num_blocks: int, num_groups: int = 1):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.used_by_group = [0] * num_groups   # blocks with a reference, per layout group
        self.on_evict = None   # (block_id, block_hash) -> None: a named block is about to be reused

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, n: int, group: int = 0) -> list[KVBlock]:
        """Take n blocks for a layout group from the LRU end, evicting their cached
        content; the caller checks num_free_blocks first."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._drop_hash(block)
            block.ref_cnt = 1
            block.group = group
            out.append(block)
        self.used_by_group[group] += n
        return out

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def take(self, blocks: list[KVBlock]) -> None:
        """Add a reference to cached blocks a request reuses (reviving free ones)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.used_by_group[block.group] += 1
            block.ref_cnt += 1

    def cache(self, block: KVBlock, block_hash: bytes) -> None:
        """Record a full block's content hash. If another block already holds the same
        content, that one stays the cached copy and this block stays private."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        self._drop_hash(block)

    def _drop_hash(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero join the free list
        in the given order (the caller passes tail blocks first so they are evicted first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                self.used_by_group[block.group] -= 1

    def reset_cache(self) -> int:
        """Forget every cached hash (e.g. after a weight update); returns how many."""
        n = len(self.cached)
        for block in list(self.cached.values()):
            block.block_hash = None
        self.cached.clear()
        return n
