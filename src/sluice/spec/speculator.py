"""Speculator: the scheduler's one handle on speculative decoding.

Each step, before the decodes are planned, it says which running requests verify drafts
and what they are (proposers.py drafts, gate.py decides whether it pays); after the step
it counts what was accepted. The runner verifies (worker/model_runner.py): a request with
d drafts puts its last token and the d drafts in the step, gets d + 1 sampled tokens, and
keeps the drafts up to the first that differs from what was sampled at its position plus
that sampled token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sluice.config import SpeculativeConfig
from sluice.spec.gate import REQUEST_DECAY, SpeculationGate
from sluice.spec.proposers import make_proposer


@dataclass
class SpecStats:
    """Cumulative counts, for /metrics and the step log."""
    steps: int = 0                 # engine steps in which some request verified drafts
    drafted: int = 0               # draft tokens verified
    accepted: int = 0              # of them, accepted
    emitted: int = 0               # tokens emitted by verifying requests (accepted + 1 each)
    # By draft position (0 = the first draft): verified, accepted.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)


def can_speculate(req) -> bool:
    """Whether a request may verify drafts now. Penalties read the output so far and
    grammars advance token by token: per drafted position both would need their own state,
    so those requests decode one token at a time (as they would with speculation off); so
    does one that opted out, and one whose min_tokens still bans its stop tokens."""
    p = req.params
    return (p.speculative and not p.has_penalties and req.grammar is None and req.held_grammar is None
            and req.num_output_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.proposer = make_proposer(config.speculative_method, config.speculative_min_match,
                                      config.suffix_cache_tokens)
        self.gate = SpeculationGate(always=config.speculative_gate == "always")
        self.stats = SpecStats(drafted_at=[0] * self.k, accepted_at=[0] * self.k)
        self.last_step = ""   # "drafted/accepted" of the last step, for the step log

    def drafts(self, decodes: list, budget: int) -> dict[str, list[int]]:
        """The drafts to verify this step, by request id, for the running requests that
        decode one token this step (`decodes`, in the order they are planned)."""
        self.last_step = ""
        if not decodes or budget <= len(decodes) or not self.gate.worth_drafting(len(decodes), self.k):
            return {}
        cands = []
        for req in decodes:
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            if room < 1 or not can_speculate(req):
                continue
            draft = self.proposer.propose(req, min(self.k, room))
            if draft:
                cands.append((self.gate.request_alpha(req.spec_accepted, req.spec_drafted), req, draft))
        if not cands:
            return {}
        cands.sort(key=lambda c: -c[0])
        m = self.gate.choose(len(decodes), [(a, len(d)) for a, _, d in cands])
        out: dict[str, list[int]] = {}
        left = budget - len(decodes)
        for _, req, draft in cands[:m]:
            draft = draft[:left]
            if draft:
                out[req.request_id] = draft
                left -= len(draft)
        return out

    def may_draft(self, num_decodes: int) -> bool:
        """Whether a step of this many decodes could speculate at all (the gate's first
        question): with asynchronous scheduling, a step whose decodes might draft next
        is finished before the next is planned, as drafts are proposed from the tokens."""
        return self.gate.worth_drafting(num_decodes, self.k)

    def verified(self, req, drafted: int, accepted: int) -> None:
        """A request's verification result (accepted <= drafted)."""
        s = self.stats
        s.drafted += drafted
        s.accepted += accepted
        s.emitted += accepted + 1
        for j in range(drafted):
            s.drafted_at[j] += 1
            if j < accepted:
                s.accepted_at[j] += 1
        req.spec_drafted = REQUEST_DECAY * req.spec_drafted + drafted
        req.spec_accepted = REQUEST_DECAY * req.spec_accepted + accepted

    def step_done(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.stats.steps += 1
            self.gate.observe_acceptance(drafted, accepted)
            self.last_step = f"spec {accepted}/{drafted} accepted"

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        self.gate.observe_step(num_tokens, seconds)

    def request_finished(self, req) -> None:
        self.proposer.request_finished(req)
