"""KVCacheManager: which blocks each request holds. The scheduler asks it for room for
new tokens and gets back an opaque KVAllocation, or None when the pool is short."""
from __future__ import annotations

from dataclasses import dataclass

from sluice.core.block_pool import BlockPool, KVBlock
from sluice.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KVAllocation:
    """Blocks newly given to a request by one allocate() call."""
    new_block_ids: tuple[int, ...]


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def allocate(self, request: Request, num_new_tokens: int) -> KVAllocation | None:
        """Room for the request's next num_new_tokens tokens, or None if the pool cannot
        supply it now (nothing is taken in that case)."""
        held = self.req_blocks.get(request.request_id, [])
        total = request.num_computed_tokens + num_new_tokens
        need = self.blocks_needed(total) - len(held)
        if need <= 0:
            return KVAllocation(())
        if need > self.pool.num_free_blocks:
            return None
        new = self.pool.allocate(need)
        self.req_blocks.setdefault(request.request_id, []).extend(new)
        return KVAllocation(tuple(b.block_id for b in new))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        if blocks:
            # Tail first: the end of a sequence is the least likely to be reused.
            self.pool.free(list(reversed(blocks)))
