"""Sessions and tenants: what the scheduler remembers between a program's calls.

A session is one agent program (its calls name the same `session_id`). When a call
ends, the full KV blocks of its prompt and output stay pinned (one extra reference each,
so the pool's LRU cannot evict them) for a time-to-live, and the session's next call,
which re-sends that history, finds them as a cached prefix and computes only its new
turn. That is Continuum's idea (arXiv 2511.02230); the TTL adapts from the gaps between
calls (ttl() below): per tool, when the server has said which tools the call ended by
calling (tool_called(); Continuum's tool-aware TTL: a web search and a code run take
different times, whichever session calls them), else per session. A session also counts
its attained service, the tokens computed for all its calls so far, which the `program`
policy orders by (Autellix's PLAS, arXiv 2502.13965).

Pins are released, in this order of preference:
  1. when they expire (checked at every schedule()), unless a call of the session is
     already queued (it is about to read them);
  2. when the session's next call is admitted (it holds the blocks itself from then on,
     and its own end pins the longer history);
  3. `DELETE /v1/sessions/{id}` (release());
  4. when pinning would take the pinned total over `max_pinned_fraction` of the cache:
     other sessions' pins: of the tenant holding the most pinned blocks, idle sessions'
     first, soonest to expire first (so a tenant's pins are pushed out by its own);
  5. when a running request needs blocks the pool does not have: before any running
     request is preempted, pins go, in the same order. A waiting request does not
     release pins to be admitted: it waits for running requests to finish, as it would
     for any full cache (the cap keeps the rest of the cache for it), and while pins are
     held an admission leaves one free block per running request, so that running
     requests' next blocks do not have to come from pins.

A tenant is the unit of fairness (the `fair` policy: the Virtual Token Counter of
Sheng et al., OSDI '24): its counter grows by the weighted tokens served to it, divided
by its weight, and the waiting tenant with the lowest counter is admitted first.

Both tables are bounded: sessions at max_sessions (the longest idle session of the
tenant with the most sessions is dropped, its pin released), tenants at MAX_TENANTS
(idle ones dropped first).
"""
from __future__ import annotations

import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable

from sluice.core.block_pool import BlockPool, KVBlock
from sluice.core.kv_cache_manager import History

# VTC's weights: an output token costs twice an input token (the paper's w_q = 2 w_p: a
# decode token takes a step's slot for one token where a prompt chunk amortizes it).
INPUT_TOKEN_COST = 1.0
OUTPUT_TOKEN_COST = 2.0
MAX_TENANTS = 4096
# The adaptive TTL: this many times the longest of the session's last GAP_HISTORY gaps.
TTL_GAP_FACTOR = 1.5
GAP_HISTORY = 8
# Tools whose gaps are remembered (per tenant and name; the least recently seen forgotten).
MAX_TOOLS = 4096


@dataclass
class Session:
    key: tuple[str, str]                 # (tenant namespace, session id)
    blocks: list[KVBlock] = field(default_factory=list)   # pinned: one reference each
    # The token blocks the pinned history stands for (every layout group's blocks of it):
    # how many, and the last one's chain hash (what a next call that re-sends it matches).
    history_blocks: int = 0
    history_hash: bytes | None = None
    expires_at: float = 0.0
    # When its pin would expire by the session's own gaps: the order pins are pushed out in
    # (tool-aware TTLs move expires_at only: ordered by them, a pin whose tool returns in
    # a second was the first pushed out, just before its call came back; the agent
    # simulation's hits fell by a third).
    release_order: float = 0.0
    last_end: float | None = None        # when its last call ended
    gaps: deque = field(default_factory=lambda: deque(maxlen=GAP_HISTORY))
    service: int = 0                     # tokens computed for all its calls
    calls: int = 0
    active: int = 0                      # calls queued or running now
    held_at_door: bool = False           # its first call waited at `program`'s door
    tools: tuple[str, ...] = ()          # the tools its last call ended by calling

    @property
    def num_pinned(self) -> int:
        return len(self.blocks)


@dataclass
class SessionStats:
    pinned_calls: int = 0        # call ends that pinned their blocks
    hits: int = 0                # calls admitted while their session held a pin
    expired: int = 0             # pins dropped by their TTL
    released: int = 0            # pins dropped by DELETE
    evicted_for_cap: int = 0     # pins dropped to stay under max_pinned_fraction
    evicted_for_room: int = 0    # pins dropped so that a running request could grow
    dropped_sessions: int = 0    # sessions forgotten to stay under max_sessions
    held_at_door: int = 0        # new programs whose first call waited at `program`'s door


class SessionTable:
    def __init__(self, pool: BlockPool, ttl_s: float, ttl_max_s: float, max_pinned_fraction: float,
                 max_sessions: int, clock: Callable[[], float] = time.monotonic):
        self.pool = pool
        self.ttl_s = ttl_s
        self.ttl_max_s = ttl_max_s
        self.max_pinned = int(max_pinned_fraction * pool.num_blocks)
        self.max_sessions = max_sessions
        self.clock = clock
        self.sessions: OrderedDict[tuple[str, str], Session] = OrderedDict()  # least recently used first
        # The sessions holding a pin: what expire() and the release order look at, every
        # step while pins exist, without walking every remembered session.
        self.pinned: dict[tuple[str, str], Session] = {}
        self.num_pinned = 0
        self.stats = SessionStats()
        # (tenant namespace, tool name) -> the gaps seen after calls that called it.
        self.tool_gaps: OrderedDict[tuple[str, str], deque] = OrderedDict()

    # -- lookup -----------------------------------------------------------------
    def get(self, key: tuple[str, str]) -> Session | None:
        return self.sessions.get(key)

    def open(self, key: tuple[str, str], now: float | None = None) -> Session:
        """The session a new call names, created if unknown (an unknown id starts a new
        session). Records the gap since its last call ended."""
        now = self.clock() if now is None else now
        s = self.sessions.get(key)
        if s is None:
            s = self.sessions[key] = Session(key)
        else:
            self.sessions.move_to_end(key)
            if s.last_end is not None and s.active == 0:
                gap = now - s.last_end
                s.gaps.append(gap)
                for name in s.tools:
                    key = (s.key[0], name)
                    gaps = self.tool_gaps.pop(key, None) or deque(maxlen=GAP_HISTORY)
                    gaps.append(gap)
                    self.tool_gaps[key] = gaps
                    if len(self.tool_gaps) > MAX_TOOLS:
                        self.tool_gaps.popitem(last=False)
        s.tools = ()
        s.calls += 1
        s.active += 1
        self._bound()
        return s

    def _bound(self) -> None:
        # Only idle sessions go (a session with a call in flight is never dropped, so a
        # call's end always finds its session in the table).
        while len(self.sessions) > self.max_sessions:
            # The tenant with the most sessions loses its longest idle one: a tenant opening
            # sessions by the thousand pushes out its own, not another tenant's.
            counts = Counter(k[0] for k, s in self.sessions.items() if s.active == 0)
            if not counts:
                return  # every session has a call in flight: the bound waits for one to end
            top = max(counts.values())
            victim = next(s for k, s in self.sessions.items() if s.active == 0 and counts[k[0]] == top)
            self._unpin(victim)
            del self.sessions[victim.key]
            self.stats.dropped_sessions += 1

    # -- pins -------------------------------------------------------------------
    def ttl(self, s: Session) -> float:
        """How long to hold a session's blocks after a call: TTL_GAP_FACTOR x the longest
        recent gap that predicts its next call (it is expected within that), at most
        ttl_max_s. The gaps that predict it: those seen after calls of the tools this call
        ended by calling (of any of the tenant's sessions; the slowest tool of a parallel
        call), once each has been seen; else the session's own; else the default TTL. A
        gap past ttl_max_s gets no pin at all: holding the blocks that long would cost more
        cache than recomputing its prompt costs time (0 returned)."""
        tools = [self.tool_gaps.get((s.key[0], name)) for name in s.tools]
        if tools and all(tools):
            longest = max(max(g) for g in tools)
        elif s.gaps:
            longest = max(s.gaps)
        else:
            return self.ttl_s
        if longest > self.ttl_max_s:
            return 0.0
        return min(self.ttl_max_s, max(TTL_GAP_FACTOR * longest, 1.0))

    def call_ended(self, s: Session, history: History | None, pin: bool) -> None:
        """A call of s ended; history: its full, computed blocks (prompt and output), still
        referenced by the request (kv_cache_manager.History). With pin, they replace the
        session's pin."""
        blocks = list(history.blocks) if history is not None else []
        now = self.clock()
        s.active = max(0, s.active - 1)
        s.last_end = now
        if not pin or self.ttl_s <= 0:
            return
        ttl = self.ttl(s)
        if ttl <= 0 or not blocks or len(blocks) > self.max_pinned:
            self._unpin(s)
            return
        # Take the new references before dropping the old ones: the two sets share the
        # session's earlier history.
        self.pool.take(blocks)
        old = s.blocks
        s.blocks = list(blocks)
        s.history_blocks, s.history_hash = history.num_full_blocks, history.last_hash
        self.num_pinned += len(blocks) - len(old)
        self.pinned[s.key] = s
        if old:
            self.pool.free(list(reversed(old)))
        s.expires_at = s.release_order = now + ttl
        self.stats.pinned_calls += 1
        over = self.num_pinned - self.max_pinned
        if over > 0:
            self.stats.evicted_for_cap += self._release_soonest(over, keep=s)

    def tool_called(self, s: Session, names: list[str]) -> None:
        """The server parsed the call that just ended: it called these tools, so the gap
        to the session's next call is theirs. A pin already set gets their TTL (from the
        call's end)."""
        if s.active:
            return  # the next call is already here: nothing to predict
        s.tools = tuple(dict.fromkeys(names))
        if s.key in self.pinned and s.last_end is not None:
            ttl = self.ttl(s)
            if ttl <= 0:
                self._unpin(s)
            else:
                s.expires_at = s.last_end + ttl

    def call_admitted(self, s: Session) -> None:
        """The session's call was admitted with its cached prefix taken: the call holds
        those blocks now, so the pin goes."""
        if s.blocks:
            self.stats.hits += 1
            self._unpin(s)

    def _unpin(self, s: Session) -> int:
        n = len(s.blocks)
        if n:
            # Tail first into the LRU list, as a request's blocks are: its end is evicted first.
            self.pool.free(list(reversed(s.blocks)))
            s.blocks = []
            self.num_pinned -= n
            del self.pinned[s.key]
        return n

    def release(self, key: tuple[str, str]) -> int | None:
        """DELETE: drop the session's pin and forget it; returns how many blocks it had
        pinned, None if unknown. (A session with a call in flight is kept: that call's end
        pins again.)"""
        s = self.sessions.get(key)
        if s is None:
            return None
        n = self._unpin(s)
        if n:
            self.stats.released += 1
        if s.active == 0:
            del self.sessions[key]
        return n

    def expire(self, now: float | None = None) -> int:
        """Drop pins past their TTL; returns how many blocks went back to the pool."""
        now = self.clock() if now is None else now
        freed = 0
        for s in list(self.pinned.values()):
            # A session with a call queued keeps its pin past the TTL: the call is about to
            # read it (the TTL bounds the wait for the next call, not its time in the queue).
            if s.expires_at <= now and s.active == 0:
                freed += self._unpin(s)
                self.stats.expired += 1
        return freed

    def free_for(self, num_blocks: int) -> int:
        """Release pins (in _next_to_release's order) until num_blocks more blocks are free
        in the pool, or no pins are left; for a running request that would otherwise be
        preempted. Returns how many pins were dropped."""
        dropped = 0
        while self.pool.num_free_blocks < num_blocks:
            s = self._next_to_release(keep=None)
            if s is None:
                break
            self._unpin(s)
            dropped += 1
        self.stats.evicted_for_room += dropped
        return dropped

    def _release_soonest(self, num_blocks: int, keep: Session) -> int:
        dropped = 0
        while num_blocks > 0:
            s = self._next_to_release(keep)
            if s is None:
                break
            num_blocks -= self._unpin(s)
            dropped += 1
        return dropped

    def _next_to_release(self, keep: Session | None) -> Session | None:
        """The pin to drop next: of the tenant holding the most pinned blocks (so a tenant's
        pins are pushed out by its own, and one alone may use the whole cap), an idle
        session's (its next call has not come yet), the soonest to expire."""
        held: Counter = Counter()
        for s in self.pinned.values():
            if s is not keep:
                held[s.key[0]] += len(s.blocks)
        if not held:
            return None
        top = max(held.values())
        return min((s for s in self.pinned.values() if s is not keep and held[s.key[0]] == top),
                   key=lambda s: (s.active > 0, s.release_order))

    def reset(self) -> None:
        """Drop every pin (a prefix-cache reset: the blocks' contents are stale)."""
        for s in list(self.pinned.values()):
            self._unpin(s)


class TenantCounters:
    """VTC: per tenant, the weighted tokens it has been served divided by its weight."""

    def __init__(self, weights: dict[str, float] | None = None):
        self.weights = dict(weights or {})
        self.counters: OrderedDict[str, float] = OrderedDict()

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, input_tokens: int, output_tokens: int) -> None:
        cost = INPUT_TOKEN_COST * input_tokens + OUTPUT_TOKEN_COST * output_tokens
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / self.weight(tenant)

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, tenant: str, backlogged: set[str]) -> None:
        """A request of `tenant` arrives. If the tenant had nothing queued or running, its
        counter is lifted to the lowest counter among backlogged tenants: an idle tenant
        does not bank credit to starve the others with later (VTC's counter lift)."""
        if tenant in backlogged:
            return
        floor = min((self.counters.get(t, 0.0) for t in backlogged if t != tenant), default=None)
        if floor is not None and self.counters.get(tenant, 0.0) < floor:
            self.counters[tenant] = floor
        self.counters.setdefault(tenant, 0.0)
        self.counters.move_to_end(tenant)
        while len(self.counters) > MAX_TENANTS:
            idle = next((t for t in self.counters if t not in backlogged and t != tenant), None)
            if idle is None:
                break
            del self.counters[idle]
