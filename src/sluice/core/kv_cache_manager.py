"""KVCacheManager: which blocks each request holds, and which full blocks can be reused.

The scheduler asks it for room for new tokens and gets back an opaque KVAllocation, or
None when the pool is short. With prefix caching, every full block is named by a chained
SHA-256 of (parent block's hash, its token ids, extra keys such as a cache salt), strong
enough that a collision cannot silently corrupt output; a new request takes the longest
run of cached blocks matching its tokens and computes only the rest. Samples of one
request (n > 1) share their prompt blocks this way even with caching off, through a salt
private to the request.

Under a KVLayout with several groups (kv_layout.py: sliding-window layers beside full
ones), a request holds one block table per group. A sliding-window group's table gives
its blocks behind the window back to the pool as the sequence grows (they keep their
hash: a later request with the same tokens may still take them), so the request holds
its window's blocks there and only its full-attention groups grow with it. A cached
prefix must then be whole in the full groups and cover the window before its end in the
sliding ones; a block is named by its chain hash and its group.

With KV offloading (an OffloadIndex, core/kv_offload.py), a named block the pool evicts
goes to a host (then disk) tier instead of being lost, and a prefix lookup that misses in
the pool looks there too: such a block takes a fresh pool block whose content a transfer
copies back before the step's forward pass (the plan carries the transfers).
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from sluice.core.block_pool import BlockPool, KVBlock
from sluice.core.kv_offload import OffloadIndex
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
    """The longest run of cached blocks matching a request's tokens: per group its table
    (None where a sliding-window group needs no block), and all of them in one tuple."""
    blocks: tuple[KVBlock, ...]
    num_tokens: int
    queried_tokens: int = 0    # the request's tokens looked up (counted once it is admitted)
    tables: tuple[tuple[KVBlock | None, ...], ...] = ()
    # Blocks an offload tier holds: (group, table index, key), each to be copied back into
    # a fresh pool block (their table entries are None until allocate() fills them).
    loads: tuple[tuple[int, int, bytes], ...] = ()


_NO_PREFIX = CachedPrefix((), 0)


@dataclass(frozen=True)
class History:
    """What a finished call leaves for its session's next call to find: every group's
    computed, named blocks that a continuation reads (a sliding group's: its window's),
    and the run of token blocks they stand for (its length and last chain hash)."""
    blocks: tuple[KVBlock, ...]
    num_full_blocks: int
    last_hash: bytes | None


_NO_HISTORY = History((), 0, None)


def group_key(chain_hash: bytes, group: int) -> bytes:
    """The pool's name for group `group`'s block of the tokens chain_hash names (group 0's
    is the chain hash itself)."""
    return chain_hash if group == 0 else chain_hash + group.to_bytes(2, "little")


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 windows: tuple[int, ...] = (0,), offload: OffloadIndex | None = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        # Per layout group: the keys its layers see (0: all of them).
        self.windows = tuple(windows) or (0,)
        self.num_groups = len(self.windows)
        self.pool = BlockPool(num_blocks, self.num_groups)
        # KV offloading: where named blocks go when the pool evicts them; None: lost.
        self.offload = offload
        if offload is not None:
            self.pool.on_evict = offload.save
        # What a table holds where a sliding group holds no block: the runner's scratch
        # block past the pool (finite values, only ever read under a window's mask).
        self.null_block_id = num_blocks
        self.req_blocks: dict[str, list[list[KVBlock | None]]] = {}   # request -> a table per group
        self.req_lo: dict[str, list[int]] = {}     # per group, the first entry it may still hold
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
        """Entries of one block table covering num_tokens tokens."""
        return cdiv(num_tokens, self.block_size)

    def _first_needed(self, group: int, pos: int) -> int:
        """The first block group `group` reads for queries at positions pos onward."""
        w = self.windows[group]
        return max(0, pos - w + 1) // self.block_size if w else 0

    def blocks_held(self, num_tokens: int) -> int:
        """Pool blocks, all groups together, that a sequence of num_tokens computed tokens
        holds on its way on (its sliding groups: their window's)."""
        n = self.blocks_needed(num_tokens)
        return sum(max(n - self._first_needed(g, num_tokens), 1 if num_tokens else 0)
                   for g in range(self.num_groups))

    def peak_blocks(self, num_tokens: int, chunk: int) -> int:
        """The most pool blocks one sequence growing to num_tokens tokens, computed in
        steps of at most `chunk` tokens, holds at once."""
        n = self.blocks_needed(num_tokens)
        return sum(n if not w else min(n, cdiv(w - 1 + chunk, self.block_size) + 1) for w in self.windows)

    def prompt_growth(self, request: Request, chunk: int) -> int:
        """Blocks a request still computing its prompt (in chunks of at most `chunk`
        tokens) will take beyond those it holds: its prompt's peak_blocks less them."""
        tables = self.req_blocks.get(request.request_id)
        held = sum(1 for t in tables for b in t if b is not None) if tables else 0
        return max(0, self.peak_blocks(request.num_prompt_tokens, chunk) - held)

    def capacity_tokens(self, chunk: int, limit: int) -> int:
        """The longest sequence (at most `limit` tokens) whose peak_blocks fit the pool."""
        if self.peak_blocks(limit, chunk) <= self.num_blocks:
            return limit
        lo, hi = 0, limit  # peak_blocks grows with the length: the last length that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(mid, chunk) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def blocks_by_group(self) -> list[int]:
        """Blocks in use (referenced by requests or pins), per layout group."""
        return list(self.pool.used_by_group)

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
        if request.lora is not None:  # an adapter's K/V differ from the base model's and another adapter's
            parts.append(f"lora\x00{request.lora.uid}")
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
    def find_cached_prefix(self, request: Request, max_blocks: int | None = None) -> CachedPrefix:
        """Cached blocks matching the start of a request that holds no blocks yet (at most
        max_blocks token blocks of it). The last token is always left to compute, so the
        request gets logits. A request that still needs prompt logprobs reads none: it
        must compute every prompt token (it still names its own blocks for others)."""
        if (not self._hashing(request) or self.req_blocks.get(request.request_id)
                or request.needs_prompt_logprobs):
            return _NO_PREFIX
        hashes = self._hashes(request, (request.num_tokens - 1) // self.block_size)
        pool_lookup, offload = self.pool.lookup, self.offload

        def lookup_tiers(key: bytes):
            """The pool's block of this content, else an offload tier's name for it, else None."""
            block = pool_lookup(key)
            return offload.where(key) if block is None else block
        lookup = pool_lookup if offload is None else lookup_tiers
        k = len(hashes) if max_blocks is None else min(len(hashes), max_blocks)
        for g, w in enumerate(self.windows):  # full groups: every block from the first
            if not w:
                k = next((i for i in range(k) if lookup(group_key(hashes[i], g)) is None), k)
        # Sliding groups: the blocks the window before token k * block_size covers. A miss
        # at block m rules out every longer prefix (each needs m too): go on below it.
        settled = False
        while not settled and k > 0:
            settled = True
            for g, w in enumerate(self.windows):
                if not w:
                    continue
                while k > 0:
                    first = self._first_needed(g, k * self.block_size)
                    miss = next((i for i in range(k - 1, first - 1, -1)
                                 if lookup(group_key(hashes[i], g)) is None), None)
                    if miss is None:
                        break
                    k, settled = miss, False
        if k == 0:
            return CachedPrefix((), 0, request.num_tokens)
        tables, loads = [], []
        for g in range(self.num_groups):
            first = self._first_needed(g, k * self.block_size)
            table: list[KVBlock | None] = [None] * first
            for i in range(first, k):
                key = group_key(hashes[i], g)
                found = lookup(key)
                if isinstance(found, str):  # in an offload tier: a fresh block, filled by a copy
                    loads.append((g, i, key))
                    found = None
                table.append(found)
            tables.append(tuple(table))
        blocks = tuple(b for t in tables for b in t if b is not None)
        return CachedPrefix(blocks, k * self.block_size, request.num_tokens, tuple(tables), tuple(loads))

    def fit_prefix(self, request: Request, prefix: CachedPrefix, num_new) -> CachedPrefix:
        """The prefix, shortened until what allocating it takes fits the free blocks, where
        it reloads offloaded blocks: each reload takes a free block at admission, where
        computing the same tokens would take them chunk by chunk (and let running requests
        release pins for them on the way). num_new(prefix): the tokens the request would
        compute this step after it."""
        while prefix.loads:
            excess = self.free_blocks_taken(request, num_new(prefix), prefix) - self.pool.num_free_blocks
            if excess <= 0:
                break
            prefix = self.find_cached_prefix(request, max(0, prefix.num_tokens // self.block_size - excess))
        return prefix

    def resends(self, request: Request, num_full_blocks: int, last_hash: bytes | None) -> bool:
        """Whether the request begins with a session's pinned history of num_full_blocks
        token blocks, the last named last_hash. The hashes are the ones find_cached_prefix
        computes for it anyway (kept per request)."""
        n = num_full_blocks
        if not n or not self._hashing(request) or (request.num_tokens - 1) // self.block_size < n:
            return False
        return self._hashes(request, n)[n - 1] == last_hash

    def free_blocks_taken(self, request: Request, num_new_tokens: int, prefix: CachedPrefix = _NO_PREFIX,
                          num_lookahead: int = 0) -> int:
        """How many free blocks allocate(request, num_new_tokens, prefix) would take: new
        ones, and cached ones it revives from the free list (a free block each too), less
        the blocks its sliding groups give back (those behind the window)."""
        rid = request.request_id
        start = request.num_computed_tokens + prefix.num_tokens
        need = self.blocks_needed(start + num_new_tokens + num_lookahead)
        tables = self.req_blocks.get(rid)
        taken = sum(1 for b in prefix.blocks if b.ref_cnt == 0) + len(prefix.loads)
        for g in range(self.num_groups):
            lo = self._first_needed(g, start)
            if tables is not None:
                table = tables[g]
                taken -= sum(1 for b in table[self.req_lo[rid][g]:lo] if b is not None and b.ref_cnt == 1)
                held = len(table)
            else:
                held = len(prefix.tables[g]) if prefix.tables else 0
            taken += max(0, need - max(held, lo))
        return taken

    def allocate(self, request: Request, num_new_tokens: int,
                 prefix: CachedPrefix = _NO_PREFIX, num_lookahead: int = 0) -> KVAllocation | None:
        """Room for the request's next num_new_tokens tokens (after its computed tokens and
        any cached prefix it takes now), or None if the pool cannot supply it now (nothing
        is taken in that case). num_lookahead more slots hold drafted tokens being verified:
        they are not the request's tokens, so no block is named by them; a rejected draft's
        slot is simply not counted as computed, and the next token overwrites it. Blocks
        behind a sliding group's window go back to the pool first."""
        if self.free_blocks_taken(request, num_new_tokens, prefix, num_lookahead) > self.pool.num_free_blocks:
            return None
        rid = request.request_id
        start = request.num_computed_tokens + prefix.num_tokens
        need = self.blocks_needed(start + num_new_tokens + num_lookahead)
        self.pool.take(list(prefix.blocks))
        # Prefix statistics per admission (a lookup for a request that then waits, and is
        # looked up again next step, is not a second query).
        self.query_tokens += prefix.queried_tokens
        self.hit_tokens += prefix.num_tokens
        tables = self.req_blocks.get(rid)
        if tables is None:
            tables = self.req_blocks[rid] = ([list(t) for t in prefix.tables] if prefix.tables
                                             else [[] for _ in self.windows])
            self.req_lo[rid] = [self._first_needed(g, start) for g in range(self.num_groups)]
        if prefix.loads:
            self._reload(tables, prefix.loads)
        self._slide(rid, start)
        new: list[KVBlock] = []
        for g, table in enumerate(tables):
            if len(table) < self.req_lo[rid][g]:
                table.extend([None] * (self.req_lo[rid][g] - len(table)))
            if need > len(table):
                got = self.pool.allocate(need - len(table), g)
                table.extend(got)
                new.extend(got)
        if self._hashing(request):
            # Name the blocks this step fills. Their K/V is written in this step's forward
            # pass before any layer reads it, so a request admitted later in the same step
            # may already share them.
            self._name(request, start + num_new_tokens)
        return KVAllocation(tuple(b.block_id for b in prefix.blocks), tuple(b.block_id for b in new))

    def _reload(self, tables: list[list[KVBlock | None]], loads) -> None:
        """Fresh pool blocks for a prefix's offloaded blocks, named at once (their content
        is copied in before the step's forward pass reads it, like a block this step fills).
        The keys are locked meanwhile: the evictions these allocations cause save blocks to
        the host tier, and must not push out what is being reloaded."""
        offload = self.offload
        offload.locked.update(key for _, _, key in loads)
        try:
            for g, i, key in loads:
                [block] = self.pool.allocate(1, g)
                tables[g][i] = block
                self.pool.cache(block, key)
                offload.load(key, block.block_id)
        finally:
            offload.locked.clear()

    def take_transfers(self) -> list[tuple[str, int, int, bytes]]:
        """The offload copies decided since the last call, in order (for the next step)."""
        return self.offload.take_transfers() if self.offload is not None else []

    def failed_load(self, block_id: int) -> None:
        """A block's reload failed: its content is not what its name says, so the name goes
        (the requests holding it are recomputed by the scheduler)."""
        self.pool.uncache(self.pool.blocks[block_id])

    def holds_any(self, request_id: str, block_ids: set[int]) -> bool:
        tables = self.req_blocks.get(request_id) or []
        return any(b is not None and b.block_id in block_ids for t in tables for b in t)

    def _slide(self, rid: str, start: int) -> None:
        """Give back each sliding group's blocks that no query at start or later reads."""
        tables, los = self.req_blocks[rid], self.req_lo[rid]
        gone: list[KVBlock] = []
        for g, w in enumerate(self.windows):
            lo = self._first_needed(g, start)
            if not w or lo <= los[g]:
                continue
            table = tables[g]
            for i in range(los[g], min(lo, len(table))):
                b = table[i]
                if b is not None:
                    if b.ref_cnt == 1 and not self.enable_caching:
                        self.pool.uncache(b)  # with caching off only live requests share
                    gone.append(b)
                    table[i] = None
            los[g] = lo
        if gone:
            self.pool.free(gone)

    def _name(self, request: Request, num_filled: int) -> None:
        """Give the request's full blocks among its first num_filled tokens their hash.
        Only blocks whose every token is known: a token still being sampled by a step in
        flight (asynchronous scheduling) names its block when it is appended (name_known)."""
        full = min(num_filled, request.num_tokens) // self.block_size
        done = self.req_num_named.get(request.request_id, 0)
        if full > done:
            tables = self.req_blocks[request.request_id]
            hashes = self._hashes(request, full)
            for g, table in enumerate(tables):
                for i in range(done, full):
                    b = table[i]
                    if b is not None and b.block_hash is None:
                        self.pool.cache(b, group_key(hashes[i], g))
            self.req_num_named[request.request_id] = full

    def name_known(self, request: Request) -> None:
        """Name the blocks a newly appended token completed (asynchronous scheduling)."""
        if self._hashing(request) and request.request_id in self.req_blocks:
            self._name(request, request.num_computed_tokens)

    def history(self, request: Request) -> History:
        """The request's computed blocks that a continuation can find as its cached prefix
        (a session pins them): the leading run of full blocks named by their content (a
        lookup stops at the first block it cannot find), in every group, a sliding group's
        from the start of its window before the run's end."""
        rid = request.request_id
        tables = self.req_blocks.get(rid)
        if not tables:
            return _NO_HISTORY
        n = min(request.num_computed_tokens // self.block_size, self.req_num_named.get(rid, 0))
        for g, table in enumerate(tables):  # the run ends at the first unnamed block it needs
            lo = self.req_lo[rid][g]
            n = next((i for i in range(lo, min(n, len(table)))
                      if table[i] is None or table[i].block_hash is None), n)
        blocks = []
        for g, table in enumerate(tables):
            first = max(self._first_needed(g, n * self.block_size), self.req_lo[rid][g])
            blocks.extend(b for b in table[first:n] if b is not None)
        if not blocks:
            return _NO_HISTORY
        return History(tuple(blocks), n, self.req_hashes[rid][n - 1])

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """One group's block table (null_block_id where it holds none)."""
        tables = self.req_blocks.get(request_id)
        if not tables:
            return []
        null = self.null_block_id
        return [null if b is None else b.block_id for b in tables[group]]

    def group_block_ids(self, request_id: str) -> list[list[int]] | None:
        """Every group's block table where the layout has several groups, else None."""
        if self.num_groups == 1:
            return None
        return [self.block_ids(request_id, g) for g in range(self.num_groups)]

    def free(self, request: Request) -> None:
        """Return a request's blocks. Blocks whose K/V it never finished computing lose
        their hash (their content is not what the hash says); with caching off, all do."""
        rid = request.request_id
        tables = self.req_blocks.pop(rid, None)
        self.req_lo.pop(rid, None)
        self.req_hashes.pop(rid, None)
        self.req_num_named.pop(rid, None)
        if not tables:
            return
        computed = request.num_computed_tokens // self.block_size
        gone: list[KVBlock] = []
        for table in tables:
            for i, block in enumerate(table):
                if block is None:
                    continue
                if block.ref_cnt == 1 and (i >= computed or not self.enable_caching):
                    self.pool.uncache(block)
                gone.append(block)
        # Tail first: the end of a sequence is the least likely to be reused.
        self.pool.free(list(reversed(gone)))

    def reset_prefix_cache(self) -> int:
        if self.offload is not None:  # offloaded content is as stale as cached content
            self.offload.clear()
            self.offload.take_transfers()
        return self.pool.reset_cache()

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.num_cached_blocks
