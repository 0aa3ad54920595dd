"""KVCacheManager: which blocks each request holds, and which full blocks can be reused.

The scheduler asks it for room for new tokens and gets back an opaque KVAllocation, or
None when the pool is short. With prefix caching, every full block is named by a chained
SHA-256 of (parent block's hash, its token ids, extra keys such as a cache salt), strong
enough that a collision cannot silently corrupt output; a new request takes the longest
run of cached blocks matching its tokens and computes only the rest. Samples of one
request (n > 1) share their prompt blocks this way even with caching off, through a salt
private to the request.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from sluice.core.block_pool import BlockPool, KVBlock
from sluice.request import Request

_ROOT = b"\x00" * 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, token_ids: list[int], extra: bytes = b"") -> bytes:
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"\xff" + extra)
    return h.digest()


@dataclass(frozen=True)
class KVAllocation:
    """Blocks given to a request by one allocate() call: reused cached ones, then new ones."""
    cached_block_ids: tuple[int, ...]
    new_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class CachedPrefix:
    """The longest run of cached blocks matching a request's tokens."""
    blocks: tuple[KVBlock, ...]
    num_tokens: int
    queried_tokens: int = 0    # the request's tokens looked up (counted once it is admitted)


_NO_PREFIX = CachedPrefix((), 0)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[bytes]] = {}
        self.req_num_named: dict[str, int] = {}   # leading blocks already given a hash
        # Prefix-cache statistics, in tokens.
        self.query_tokens = 0
        self.hit_tokens = 0

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

    # -- hashing --------------------------------------------------------------
    def _hashing(self, request: Request) -> bool:
        return self.enable_caching or request.share_key is not None or request.session_id is not None

    def _salt(self, request: Request) -> bytes:
        # With caching off only a request's own samples may share (salt = the parent id),
        # and a session's calls with each other (salt = its tenant and id).
        parts = [request.cache_salt or ""]
        if not self.enable_caching:
            parts.append(request.share_key or "")
            if request.session_id is not None:
                parts.append(f"session\x00{request.tenant}\x00{request.session_id}")
        return "\x00".join(parts).encode() if any(parts) else b""

    def _hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """The request's block hashes up to num_full_blocks, extended lazily."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else _ROOT
            extra = self._salt(request) if i == 0 else b""
            hashes.append(block_hash(parent, request.token_ids_slice(i * bs, (i + 1) * bs), extra))
        return hashes

    # -- allocation -----------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """Cached blocks matching the start of a request that holds no blocks yet. The
        last token is always left to compute, so the request gets logits. A request that
        still needs prompt logprobs reads none: it must compute every prompt token (it still
        names its own blocks for others)."""
        if (not self._hashing(request) or self.req_blocks.get(request.request_id)
                or request.needs_prompt_logprobs):
            return _NO_PREFIX
        usable = (request.num_tokens - 1) // self.block_size
        found: list[KVBlock] = []
        for h in self._hashes(request, usable):
            block = self.pool.lookup(h)
            if block is None:
                break
            found.append(block)
        return CachedPrefix(tuple(found), len(found) * self.block_size, request.num_tokens)

    def resends(self, request: Request, blocks: list[KVBlock]) -> bool:
        """Whether the request begins with the content of `blocks` (a session's pinned
        history): the hash of its len(blocks)-th full block is the last one's. The hashes
        are the ones find_cached_prefix computes for it anyway (kept per request)."""
        n = len(blocks)
        if not n or not self._hashing(request) or (request.num_tokens - 1) // self.block_size < n:
            return False
        return self._hashes(request, n)[n - 1] == blocks[-1].block_hash

    def _new_blocks(self, request: Request, num_new_tokens: int, prefix: CachedPrefix, num_lookahead: int = 0) -> int:
        """Blocks allocate() adds to those the request holds and the prefix it takes."""
        held = len(self.req_blocks.get(request.request_id, ()))
        total = request.num_computed_tokens + prefix.num_tokens + num_new_tokens + num_lookahead
        return max(self.blocks_needed(total) - held - len(prefix.blocks), 0)

    def free_blocks_taken(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = _NO_PREFIX,
                          num_lookahead: int = 0) -> int:
        """How many free blocks allocate(request, num_new_tokens, prefix) would take: new
        ones, and cached ones it revives from the free list (a free block each too)."""
        return (self._new_blocks(request, num_new_tokens, prefix, num_lookahead)
                + sum(1 for b in prefix.blocks if b.ref_cnt == 0))

    def allocate(self, request: Request, num_new_tokens: int,
                 prefix: CachedPrefix = _NO_PREFIX, num_lookahead: int = 0) -> KVAllocation | None:
        """Room for the request's next num_new_tokens tokens (after its computed tokens and
        any cached prefix it takes now), or None if the pool cannot supply it now (nothing
        is taken in that case). num_lookahead more slots hold drafted tokens being verified:
        they are not the request's tokens, so no block is named by them; a rejected draft's
        slot is simply not counted as computed, and the next token overwrites it."""
        if self.free_blocks_taken(request, num_new_tokens, prefix, num_lookahead) > self.pool.num_free_blocks:
            return None
        need = self._new_blocks(request, num_new_tokens, prefix, num_lookahead)
        self.pool.take(list(prefix.blocks))
        # Prefix statistics per admission (a lookup for a request that then waits, and is
        # looked up again next step, is not a second query).
        self.query_tokens += prefix.queried_tokens
        self.hit_tokens += prefix.num_tokens
        new = self.pool.allocate(need) if need > 0 else []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(prefix.blocks)
        blocks.extend(new)
        if self._hashing(request):
            # Name the blocks this step fills. Their K/V is written in this step's forward
            # pass before any layer reads it, so a request admitted later in the same step
            # may already share them.
            self._name(request, request.num_computed_tokens + prefix.num_tokens + num_new_tokens)
        return KVAllocation(tuple(b.block_id for b in prefix.blocks), tuple(b.block_id for b in new))

    def _name(self, request: Request, num_filled: int) -> None:
        """Give the request's full blocks among its first num_filled tokens their hash.
        Only blocks whose every token is known: a token still being sampled by a step in
        flight (asynchronous scheduling) names its block when it is appended (name_known)."""
        full = min(num_filled, request.num_tokens) // self.block_size
        done = self.req_num_named.get(request.request_id, 0)
        if full > done:
            blocks = self.req_blocks[request.request_id]
            hashes = self._hashes(request, full)
            for i in range(done, full):
                if blocks[i].block_hash is None:
                    self.pool.cache(blocks[i], hashes[i])
            self.req_num_named[request.request_id] = full

    def name_known(self, request: Request) -> None:
        """Name the blocks a newly appended token completed (asynchronous scheduling)."""
        if self._hashing(request) and request.request_id in self.req_blocks:
            self._name(request, request.num_computed_tokens)

    def computed_blocks(self, request: Request) -> list[KVBlock]:
        """The leading run of the request's full blocks whose K/V is computed and which are
        named by their content: what a later request with the same tokens finds as its
        cached prefix (a lookup stops at the first block it cannot find)."""
        blocks = self.req_blocks.get(request.request_id, [])
        full = min(request.num_computed_tokens // self.block_size, self.req_num_named.get(request.request_id, 0))
        out = []
        for b in blocks[:full]:
            if b.block_hash is None:
                break
            out.append(b)
        return out

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def free(self, request: Request) -> None:
        """Return a request's blocks. Blocks whose K/V it never finished computing lose
        their hash (their content is not what the hash says); with caching off, all do."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self.req_hashes.pop(request.request_id, None)
        self.req_num_named.pop(request.request_id, None)
        if not blocks:
            return
        computed = request.num_computed_tokens // self.block_size
        for i, block in enumerate(blocks):
            if block.ref_cnt == 1 and (i >= computed or not self.enable_caching):
                self.pool.uncache(block)
        # Tail first: the end of a sequence is the least likely to be reused.
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> int:
        return self.pool.reset_cache()

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks
