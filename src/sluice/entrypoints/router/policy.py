"""Which replica serves a request: session and response affinity first, then the policy.

  round_robin   the next healthy replica in turn.
  least_loaded  the healthy replica with the fewest requests in flight (through this router).
  cache_aware   sgl-router's policy: each replica has an approximate prefix tree of the
                request texts sent to it; when load is imbalanced (the busiest replica has
                more than `balance_abs` requests more than the idlest, and more than
                `balance_rel` times as many) the idlest replica; else, when some replica's
                tree matches more than `cache_threshold` of the request's text, the one
                matching the longest prefix (its KV cache likely holds that prefix); else
                the replica whose tree is smallest (the most cache to spare); a text
                shorter than one piece, the idlest (ties in turn).

The tree is approximate: the text cut into CHUNK-character pieces, each named by a hash
chained over the pieces before it (the engine names KV blocks the same way), kept per
replica in an LRU of at most `max_chunks` names. A request matches a replica for as many
leading pieces as the replica's LRU holds. It is the text the router saw, not what the
replica's cache still holds: its own LRU evicts independently.

Every call of a session (`session_id`, per tenant) goes to the replica that served the
session's last call, where its KV is pinned; a Responses request with
`previous_response_id` to the replica that stored that response. If that replica is down,
the policy picks another (the KV is gone with it).
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

POLICIES = ("round_robin", "least_loaded", "cache_aware")
CHUNK = 64              # characters per prefix-tree piece (~16 tokens: about one KV block)
MAX_AFFINITY = 100_000  # sessions and stored responses remembered (least recently used dropped)


def chunk_hashes(text: str) -> list[int]:
    """The chained hashes of text's full CHUNK-character pieces."""
    out, h = [], 0
    for i in range(0, len(text) - CHUNK + 1, CHUNK):
        h = hash((h, text[i:i + CHUNK]))
        out.append(h)
    return out


class PrefixTree:
    """One replica's approximate prefix tree: chunk names in LRU order."""

    def __init__(self, max_chunks: int):
        self.max_chunks = max_chunks
        self.chunks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.chunks)

    def match(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.chunks:
                break
            n += 1
        return n

    def insert(self, hashes: list[int]) -> None:
        for h in hashes:
            self.chunks[h] = None
            self.chunks.move_to_end(h)
        while len(self.chunks) > self.max_chunks:
            self.chunks.popitem(last=False)


class _LRU(OrderedDict):
    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > MAX_AFFINITY:
            self.popitem(last=False)


@dataclass
class RouterPolicy:
    num_replicas: int
    policy: str = "cache_aware"
    # sgl-router's defaults (and vllm-router's): 0.3, 64, 1.5.
    cache_threshold: float = 0.3
    balance_abs: int = 64
    balance_rel: float = 1.5
    max_chunks: int = 200_000
    inflight: list[int] = field(default_factory=list)
    trees: list[PrefixTree] = field(default_factory=list)

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(POLICIES)}; got {self.policy!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        self.inflight = [0] * self.num_replicas
        self.trees = [PrefixTree(self.max_chunks) for _ in range(self.num_replicas)]
        self.sessions = _LRU()    # (tenant, session id) -> replica
        self.responses = _LRU()   # stored response id -> replica
        self._turn = itertools.count()

    def pick(self, healthy: list[int], text: str = "", session=None, response_id: str | None = None
             ) -> tuple[int, str]:
        """(replica, why) for a request; `healthy` must not be empty."""
        for key, table, why in ((session, self.sessions, "session"), (response_id, self.responses, "response")):
            if key is not None and table.get(key) in healthy:
                table.move_to_end(key)
                return self._chosen(table[key], text, why)
        if self.policy == "round_robin":
            return self._chosen(healthy[next(self._turn) % len(healthy)], text, "round_robin", session)
        if self.policy == "least_loaded":
            return self._chosen(self._idlest(healthy), text, "least_loaded", session)
        loads = [self.inflight[r] for r in healthy]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > self.balance_rel * min(loads):
            return self._chosen(self._idlest(healthy), text, "balance", session)
        hashes = chunk_hashes(text)
        if hashes:
            matched = {r: self.trees[r].match(hashes) for r in healthy}
            best = max(healthy, key=lambda r: (matched[r], -self.inflight[r]))
            if matched[best] * CHUNK > self.cache_threshold * len(text):
                return self._chosen(best, text, "cache_hit", session, hashes)
        if not hashes:  # too short to be cached anywhere: only the load tells replicas apart
            return self._chosen(self._idlest(healthy), text, "cache_miss", session, hashes)
        roomiest = min(healthy, key=lambda r: (len(self.trees[r]), self.inflight[r], r))
        return self._chosen(roomiest, text, "cache_miss", session, hashes)

    def _idlest(self, healthy: list[int]) -> int:
        start = next(self._turn)  # ties in turn, not always the first
        order = healthy[start % len(healthy):] + healthy[:start % len(healthy)]
        return min(order, key=lambda r: self.inflight[r])

    def _chosen(self, replica: int, text: str, why: str, session=None, hashes: list[int] | None = None):
        if session is not None:
            self.sessions.put(session, replica)
        if self.policy == "cache_aware":
            self.trees[replica].insert(hashes if hashes is not None else chunk_hashes(text))
        return replica, why

    def stored(self, response_id: str, replica: int) -> None:
        """A Responses API response stored on `replica` (its chain continues there)."""
        self.responses.put(response_id, replica)

    def forget(self, replica: int) -> None:
        """A replica restarted: its cache and pins are gone."""
        self.trees[replica] = PrefixTree(self.max_chunks)
        for table in (self.sessions, self.responses):
            for key in [k for k, r in table.items() if r == replica]:
                del table[key]
