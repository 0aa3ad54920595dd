"""Drafts without a second model: the tokens that followed the longest earlier match of a
request's last tokens.

  ngram   prompt lookup (vLLM's `ngram`, llama.cpp's lookup decoding): the match is
          searched in the request's own prompt and output.
  suffix  suffix decoding (Arctic Inference's idea, for agent loops that repeat their own
          earlier outputs): the request's own tokens and the recent outputs of requests of
          the same tenant. Never another tenant's: whether a draft is accepted shows in a
          request's timing, so a shared store would leak one tenant's text to another.

Both look the match up in a TokenIndex: every bigram of a sequence with the positions
where it ends. The context's last bigram gives the candidate positions; each is extended
backwards while the tokens agree, and the longest match (the most recent among equals)
wins. That is the longest-suffix query a suffix tree answers, bounded per step by
MAX_PER_KEY candidates x MAX_MATCH comparisons, with O(1) work per appended token, so a
request's index grows with its tokens at no per-step rebuild.
"""
from __future__ import annotations

from collections import OrderedDict

# Positions kept per bigram (the most recent): a bound on the work of one lookup.
MAX_PER_KEY = 8
# A match is extended backwards at most this far (longer is no more telling).
MAX_MATCH = 16
# Drafted tokens per matched token (draft_length).
LENGTH_FACTOR = 1.0
# Separates the documents of a tenant's store, so that no match spans two.
_SEP = -1
# Context tokens kept before each stored output (its matches start in the prompt's end).
STORED_PROMPT_TAIL = 8
# Tenants whose stores are kept at most (the least recently used dropped).
MAX_TENANTS = 256


def draft_length(match: int, k: int) -> int:
    """Tokens to draft after a match of `match` tokens, at most k: as many as matched
    (Arctic's suffix decoding scales its drafts with the match the same way). A long match
    is a copy in progress and its continuation is likely right; a two-token match is as
    likely a coincidence, and every draft costs a row of the step."""
    return min(k, max(1, int(match * LENGTH_FACTOR)))


class TokenIndex:
    """A growing token sequence and, per bigram, where it ends (the newest MAX_PER_KEY)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.where: dict[tuple[int, int], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new_tokens) -> None:
        t, where = self.tokens, self.where
        for x in new_tokens:
            if t:
                key = (t[-1], x)
                ends = where.get(key)
                if ends is None:
                    where[key] = [len(t)]
                else:
                    ends.append(len(t))
                    if len(ends) > MAX_PER_KEY:
                        del ends[0]
            t.append(x)

    def match(self, context: list[int], before: int | None = None) -> tuple[int, int]:
        """(length, start of the continuation) of the longest suffix of `context` found
        ending before position `before` (default: anywhere) with at least one token
        after it; (0, -1) if none."""
        if len(context) < 2:
            return 0, -1
        ends = self.where.get((context[-2], context[-1]))
        if not ends:
            return 0, -1
        t = self.tokens
        limit = len(t) - 1 if before is None else min(before, len(t) - 1)
        best, best_end = 0, -1
        longest = min(MAX_MATCH, len(context))
        for end in reversed(ends):
            if end >= limit:
                continue
            m = 2
            while m < longest and end - m >= 0 and t[end - m] == context[-1 - m]:
                m += 1
            if m > best:
                best, best_end = m, end
                if m == longest:
                    break
        return (best, best_end + 1) if best else (0, -1)


class _RequestIndex:
    """A request's own tokens, indexed; kept in step with the request as it grows."""
    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index = TokenIndex()

    def sync(self, req) -> TokenIndex:
        idx = self.index
        n = len(idx)
        p = len(req.prompt_token_ids)
        if n < p:
            idx.extend(req.prompt_token_ids[n:])
            n = p
        if n < req.num_tokens:
            idx.extend(req.output_token_ids[n - p:])
        return idx


class NgramProposer:
    """Prompt lookup: a draft from the request's own earlier tokens."""

    def __init__(self, min_match: int = 2) -> None:
        self.min_match = min_match
        self._indexes: dict[str, _RequestIndex] = {}

    def _own(self, req) -> tuple[TokenIndex, list[int], int, int]:
        state = self._indexes.get(req.request_id)
        if state is None:
            state = self._indexes[req.request_id] = _RequestIndex()
        idx = state.sync(req)
        tail = idx.tokens[-MAX_MATCH:]
        length, start = idx.match(tail)
        return idx, tail, length, start

    def propose(self, req, k: int) -> list[int]:
        """Up to k drafted tokens to follow the request's tokens; [] if no match."""
        idx, _tail, length, start = self._own(req)
        if length < self.min_match:
            return []
        return idx.tokens[start:start + draft_length(length, k)]

    def request_finished(self, req) -> None:
        self._indexes.pop(req.request_id, None)


class SuffixProposer(NgramProposer):
    """Suffix decoding: the longest match in the request's own tokens or its tenant's
    recent outputs (per tenant, `cache_tokens` at most; the oldest half dropped past it)."""

    def __init__(self, min_match: int = 2, cache_tokens: int = 65536) -> None:
        super().__init__(min_match)
        self.cache_tokens = cache_tokens
        self._stores: OrderedDict[str, TokenIndex] = OrderedDict()

    def propose(self, req, k: int) -> list[int]:
        idx, tail, length, start = self._own(req)
        source = idx
        store = self._stores.get(req.tenant)
        if store is not None:
            s_len, s_start = store.match(tail)
            if s_len > length:  # the request's own context wins ties: it is the likelier
                source, length, start = store, s_len, s_start
        if length < self.min_match:
            return []
        draft = source.tokens[start:start + draft_length(length, k)]
        if _SEP in draft:
            draft = draft[:draft.index(_SEP)]
        return draft

    def request_finished(self, req) -> None:
        super().request_finished(req)
        if not self.cache_tokens or not req.output_token_ids:
            return
        store = self._stores.get(req.tenant)
        if store is None:
            store = self._stores[req.tenant] = TokenIndex()
            if len(self._stores) > MAX_TENANTS:
                self._stores.popitem(last=False)
        else:
            self._stores.move_to_end(req.tenant)
        doc = req.prompt_token_ids[-STORED_PROMPT_TAIL:] + req.output_token_ids + [_SEP]
        if len(store) + len(doc) > self.cache_tokens:
            # Keep the newer half (whole documents), re-indexed: amortised O(1) per token.
            kept = store.tokens[len(store.tokens) // 2:]
            kept = kept[kept.index(_SEP) + 1:] if _SEP in kept else []
            store = self._stores[req.tenant] = TokenIndex()
            store.extend(kept)
        store.extend(doc[-self.cache_tokens:])

    def tenant_tokens(self, tenant: str) -> int:
        """Tokens stored for a tenant (0 if none)."""
        store = self._stores.get(tenant)
        return len(store) if store is not None else 0


def make_proposer(method: str, min_match: int, cache_tokens: int) -> NgramProposer:
    if method == "ngram":
        return NgramProposer(min_match)
    if method == "suffix":
        return SuffixProposer(min_match, cache_tokens)
    raise ValueError(f"unknown speculative method {method!r}: expected ngram or suffix")
