"""Scheduler: iteration-level scheduling under one token budget per step.

There is no prefill phase. Every request has tokens (prompt + outputs) and a count of
computed tokens; each step the scheduler lets computed tokens catch up, decodes first,
then prefill chunks of running requests, then new admissions from the waiting queue,
all under `max_num_batched_tokens`. A prompt bigger than what is left of the budget is
split over steps (chunked prefill). When the KV pool runs dry, pinned session blocks
are released first (core/sessions.py), then a running request is preempted: its blocks
are freed and it is requeued, to be recomputed from its tokens later.

Who is admitted next, and who is preempted, is the policy's (SchedulerConfig.policy):
  fcfs      arrival order; a preempted request goes back to the front; the most recently
            admitted is preempted.
  priority  the lowest `priority` value first, ties by arrival (vLLM's semantics); the
            highest value, latest arrival, is preempted.
  program   Autellix's PLAS: the call whose program (session) has had the least service so
            far (tokens computed for all its calls) first, ties by arrival; a call waiting
            longer than starvation_s goes ahead of all that have not waited as long; the
            running call of the most-served program is preempted. A call without a session
            is a program of its own. Warm calls first: a call that re-sends the history its
            session holds pinned goes ahead of every cold call (then PLAS among each): it
            computes only its new turn, the cheapest work in the queue, and each step it
            waits its pin holds cache that serves nobody; under PLAS alone a long
            program's pinned next call waited behind every new program, and its pin was
            pushed out (cap, room) before it ran (docs/benchmarks.md, "Agent programs").
            And a door: a new program's first call enters only while the live programs'
            KV (running calls' blocks and pins) leaves room for its prompt within the pin
            budget (max_pinned_fraction of the cache); else it waits until live programs
            finish, and the earliest new program that fits enters first (_door_open).
            With a KV offload tier the door counts running calls' blocks only, against
            half the pin budget (pins pushed out go to the tier, not lost), and the calls
            inside go warm first, then in arrival order (PLAS's least-served-first costs
            the tail more than it saves once histories are not lost: _program_key).
  fair      VTC: the waiting request of the tenant with the lowest counter (weighted tokens
            served / weight) first, in arrival order within a tenant; the running request of
            the tenant with the highest counter is preempted.
  auto      (the default) program while a call that carries a session is queued or
            running, else fcfs. Requests without sessions are ordered as they always were;
            agent programs, which say who they are by their session_id, get the policy
            that is never behind FCFS on their load and 2-8x faster at its median where
            FCFS thrashes (docs/benchmarks.md, "The agent sweep"). Under program a
            sessionless request is a program of its own with no service yet, so it is not
            put behind the agents either.
Sessions (pinned KV between calls) work under every policy.

Stalls. A request resumed after a preemption that has not sampled a token since is the
last a policy preempts (under fcfs, whose victim is the latest admitted, it was otherwise
preempted again at once, over and over: a 96-client run on a small cache saw a stream
wait 11.6 s between two tokens). With SchedulerConfig.max_stream_stall_s, a waiting
request whose stream has had tokens (its own, or for n > 1 its siblings': the client reads
one stream) is resumed ahead of new work (oldest last token first),
and once its last token is that old, running requests that have sampled since their own
admission are preempted (the policy's victim order among them) to make room and a seat
for it at the start of the step. So a stream's tokens stop for at most the bound plus the
recompute of its context (one step for a context within the step's token budget), as
long as some running request has made progress to give way; each resumption yields a
token before its request can be taken out again, so rotation never livelocks.

Asynchronous scheduling (SchedulerConfig.async_scheduling; the engine's overlap loop):
step N is planned while step N - 1 still runs. advance(plan) counts a launched step's
tokens as computed at once and gives each request it samples for one pending token, so the
next plan already has that request's decode, whose input the runner takes from step N - 1's
output on the device; update(plan, result, advanced=True) later appends the real tokens and
runs the stop checks. A request that stops on that token has one wasted row in step N,
dropped when step N is processed. Who needs its tokens on the host before its next step
(drafts, grammars, penalties) makes the engine finish the in-flight step first.

Speculative decoding (spec/): before the decodes are planned, the speculator says which
decoding requests verify drafted tokens this step; such a request puts its last token and
the drafts in the step (under what the budget leaves after the step's prompt work, with
KV slots for the drafts), and update()
appends the tokens verification kept, one by one, each through the stop checks.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.core.latency_target import StepTimeModel
from sluice.core.sessions import SessionTable, TenantCounters
from sluice.request import LogprobRow, Request, RequestStatus
from sluice.sampling_params import SamplingParams
from sluice.spec.speculator import Speculator

logger = logging.getLogger(__name__)


@dataclass
class ScheduledRequest:
    """One request's share of a step: everything the runner needs, nothing more."""
    request_id: str
    token_ids: list[int]            # tokens to compute this step
    start_pos: int                  # position of token_ids[0] (= tokens already computed)
    block_ids: list[int]            # its block table (the layout's first group's)
    needs_logits: bool              # a decode, or the last chunk of a prompt
    params: SamplingParams
    # Read-only views for penalties; the runner never mutates them.
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    # Token ids to forbid this step (EOS and stop ids while min_tokens is unmet).
    banned_token_ids: list[int] = field(default_factory=list)
    # Prompt logprobs due this step: logits positions [lo, hi) of this chunk, each scoring
    # the prompt token after it (prompt_token_ids[p + 1]); None when none are due.
    prompt_logprob_positions: tuple[int, int] | None = None
    # Its structured_outputs parser state (structured/grammar.py) when a token is due:
    # the runner masks its logits to what the grammar allows; update() feeds it the token.
    grammar: object | None = None
    # Speculative decoding: the drafted tokens at the end of token_ids, to verify. Logits
    # are due at the last 1 + len(draft_token_ids) positions.
    draft_token_ids: list[int] = field(default_factory=list)
    # Asynchronous scheduling: the last of token_ids is the one the step in flight samples
    # for this request (a placeholder here; the runner takes it from that step's output).
    pending_input: bool = False
    # Every layout group's block table, where sliding-window layers have groups of their
    # own (core/kv_layout.py); None with one group (block_ids is then all of it).
    group_block_ids: list[list[int]] | None = None
    # Its LoRA adapter (lora/adapters.py LoRAAdapter), None: the base model.
    lora: object | None = None


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)
    # KV offloading: copies between the pool and the offload tiers, (kind, src, dst, key)
    # in order (core/kv_offload.py), done before this step's forward pass.
    kv_transfers: list[tuple[str, int, int, bytes]] = field(default_factory=list)

    @property
    def reloads(self) -> bool:
        """Whether a block is copied back from a tier (a copy that can fail: the step's
        result says so, and the next plan must wait for it)."""
        return any(t[0] in ("load", "load_disk") for t in self.kv_transfers)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    # Present when the request asked for logprobs: the chosen token's and the top-N's
    # (request.LogprobRow), made a dict by the output processor, which has their texts.
    logprobs: LogprobRow | None = None


@dataclass
class PromptLogprobs:
    """Prompt logprobs from one step: entries[j] scores prompt token start + j + 1, the
    prompt token's and the top-N's (request.LogprobRow)."""
    start: int
    entries: list[LogprobRow]


@dataclass
class StepResult:
    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # Speculative decoding: the tokens after sampled[id] that verification kept (the
    # accepted drafts after the first, then the token sampled after the last accepted).
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    # KV offloading: the plan's reloads that failed, (kind, key, block id); the requests
    # holding those blocks computed garbage this step and are recomputed.
    failed_loads: list[tuple[str, bytes, int]] = field(default_factory=list)


@dataclass
class StepUpdate:
    with_new_token: list[Request]   # requests that got a token this step
    finished: list[Request]         # requests that left the batch this step
    # How many tokens each of with_new_token got, where more than one (speculation).
    num_new_tokens: dict[str, int] = field(default_factory=dict)


def _adapter_waits(req: Request, full: set | None) -> bool:
    """Its adapter is not among `full`, the adapters filling every slot (_adapters_full)."""
    return full is not None and req.lora is not None and req.lora.uid not in full


def _todo(req: Request) -> int:
    """Tokens of the request still to compute, its pending one included."""
    return req.num_tokens + req.num_pending - req.num_computed_tokens


class Scheduler:
    def reset_prefix_cache(self) -> int:
        self.sessions.reset()  # pinned contents are stale too (a weight update)
        return self.kv.reset_prefix_cache()

    def release_session(self, tenant: str, session_id: str) -> int | None:
        """Drop a session's pinned blocks (DELETE /v1/sessions/{id}); None if unknown."""
        return self.sessions.release((tenant, session_id))

    def session_tool_called(self, tenant: str, session_id: str, names: list[str]) -> bool:
        """The session's call that just ended called these tools (its pin's TTL follows
        them, core/sessions.py); False if the session is unknown."""
        s = self.sessions.get((tenant, session_id))
        if s is None:
            return False
        self.sessions.tool_called(s, names)
        return True

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int, clock=time.monotonic,
                 speculator: Speculator | None = None, max_loras: int | None = None):
        if config.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is unset: EngineConfig.validate() picks the device's default")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.num_stall_resumptions = 0  # streams brought back by max_stream_stall_s
        self.sessions = SessionTable(kv.pool, config.session_ttl_s, config.session_ttl_max_s,
                                     config.max_pinned_fraction, config.max_sessions, clock)
        # Calls carrying a session, queued or running: what `auto` switches on.
        self.num_session_calls = 0
        self.tenants = TenantCounters(config.tenant_weights)
        # Per step, for the step log and metrics: the policy's admissions and preemptions.
        self.last_decisions: list[str] = []
        # --target-tpot-ms: each step's budget from the measured step times (latency_target.py).
        self.step_model = (StepTimeModel(config.target_tpot_ms / 1e3) if config.target_tpot_ms is not None
                           else None)
        self.last_budget = config.max_num_batched_tokens
        # Speculative decoding (spec/): who verifies drafts each step; None: off.
        self.spec = speculator
        # The last step's tokens: (prompt, decode, drafted, seconds) (observe_step).
        self.last_mix = (0, 0, 0, 0.0)
        # LoRA adapters (lora/): the most distinct adapters running at once (their resident
        # slots); None: no adapters served.
        self.max_loras = max_loras

    def observe_step(self, plan: "StepPlan", seconds: float) -> None:
        """The engine's measured wall time of a step (for the latency target), and what
        the step held (last_mix, for the dashboard)."""
        decode = drafted = 0
        for e in plan.scheduled:
            if e.start_pos >= len(e.prompt_token_ids):
                decode += len(e.token_ids)
            drafted += len(e.draft_token_ids)
        self.last_mix = (plan.num_batched_tokens - decode, decode, drafted, seconds)
        prompt = plan.num_batched_tokens - decode
        if self.kv.offload is not None and prompt >= max(decode, 1) and not plan.reloads:
            # A prompt-heavy step's cost per token: what a reload saves (kv_offload.py).
            self.kv.offload.observe_prefill(plan.num_batched_tokens, seconds)
        if self.step_model is not None:
            self.step_model.observe(plan.num_batched_tokens, seconds, decode > 0)
        if self.spec is not None:
            self.spec.observe_step(plan.num_batched_tokens, seconds)

    # -- queues ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if self.config.policy == "fair":
            self.tenants.arrive(request.tenant, self._backlogged_tenants())
        self.requests[request.request_id] = request
        if request.session_id is not None:
            request.session = self.sessions.open((request.tenant, request.session_id), self.clock())
            self.num_session_calls += 1
        self.waiting.append(request)

    @property
    def policy(self) -> str:
        """The policy deciding now: the configured one, `auto` resolved."""
        if self.config.policy != "auto":
            return self.config.policy
        return "program" if self.num_session_calls else "fcfs"

    def _backlogged_tenants(self) -> set[str]:
        return {r.tenant for r in self.waiting} | {r.tenant for r in self.running}

    def _service(self, req: Request) -> int:
        """The attained service of the request's program: its session's, else its own."""
        return req.session.service if req.session is not None else req.served_tokens

    def _is_warm(self, req: Request) -> bool:
        """A call that re-sends the history its session holds pinned (only its new turn
        is left to compute)."""
        s = req.session
        return s is not None and s.num_pinned > 0 and self.kv.resends(req, s.history_blocks, s.history_hash)

    def _next_waiting(self, now: float) -> Request | None:
        """The waiting request the policy admits next (None: none may enter now)."""
        policy = self.policy
        waiting = self.waiting
        full = self._adapters_full()
        if full is not None:
            # The requests behind one whose adapter has no slot go ahead (vLLM's scheduler
            # skips it the same way).
            waiting = [r for r in waiting if not _adapter_waits(r, full)]
            if not waiting:
                return None
        if self.config.max_stream_stall_s is not None:
            # The bounded stall: a stream out of the batch goes first, the oldest last token first.
            stalled = [r for r in waiting if r.last_token_time is not None]
            if stalled:
                return min(stalled, key=lambda r: r.last_token_time)
        if policy == "fcfs":
            return waiting[0]
        if policy == "priority":
            return min(waiting, key=lambda r: (r.priority, r.arrival_time))
        if policy == "program":
            door_open = self._door_open(now)
            inside = [r for r in waiting if door_open(r)]
            return min(inside, key=lambda r: self._program_key(r, now)) if inside else None
        # fair: the lowest-counter tenant's earliest request (waiting keeps arrival order,
        # preempted requests at the front).
        tenant = min({r.tenant for r in waiting}, key=lambda t: (self.tenants.counter(t), t))
        return next(r for r in waiting if r.tenant == tenant)

    def _program_key(self, r: Request, now: float) -> tuple:
        """`program`'s order among the waiting calls the door lets in (smallest first).

        With a KV offload tier, warm calls first and then arrival order, not PLAS: once a
        pushed-out history comes back as a copy, what PLAS buys (short programs not stuck
        behind long ones that are about to lose their histories anyway) is small, and what
        it costs shows: the most-served programs, the tail, always go last. In the
        simulated sweep arrival order took the long shape's p99 from 6.07x / 4.00x FCFS's
        to 7.75x / 5.76x at its two thrashing cells (0.25 GiB) and its p50 from 5.76x to
        6.87x at the heavier one; the short shape's cells moved within 0.2x both ways
        (docs/lab-notes.md, "The door with a tier")."""
        if now - r.arrival_time >= self.config.starvation_s:
            return (0, 0, 0, r.arrival_time)  # starved: ahead of the rest, oldest first
        if self.kv.offload is not None:
            return (1, not self._is_warm(r), 0, r.arrival_time)
        return (1, not self._is_warm(r), self._service(r), r.arrival_time)

    def _prompt_work(self, order: list[Request], budget: int, admit_more: bool) -> int:
        """Prompt tokens this step could carry (prefilling requests', then the waiting ones'
        where the step may admit), counted up to the budget: past it nothing is left for
        drafts anyway, and a long queue is not summed every step."""
        work = 0
        for r in order:
            if (n := _todo(r)) > 1:
                work += n
        if admit_more and len(self.running) < self.config.max_num_seqs:
            for r in self.waiting:
                if work >= budget:
                    break
                work += r.num_tokens
        return work

    def _adapters_full(self) -> set | None:
        """The adapters running when they fill max_loras (a request of another adapter
        waits until one of them ends), else None."""
        if self.max_loras is None:
            return None
        running = {r.lora.uid for r in self.running if r.lora is not None}
        return running if len(running) >= self.max_loras else None

    def _door_open(self, now: float):
        """`program`'s door: a new program (a session's first call, never admitted yet)
        enters only while the live programs' KV (blocks held by running calls and pins)
        and its prompt fit the pin budget (max_pinned_fraction of the cache); else it
        waits until live programs finish. Without it, at a load past what the cache
        holds, each new program's history pushed out a live one's, whose next call then
        recomputed its whole history: hits fell to ~20%, and the server's capacity with
        them (docs/benchmarks.md, "Agent programs").

        Passing without a check: calls of programs already inside, calls without a
        session, any call when nothing runs, a prompt too big to be pinned anyway, every
        call when pins are off, and a new program that has waited session_ttl_max_s (the
        longest a pin is held after a call: past it the door is shut by sessions that
        keep calling, which must not shut it for good; a bound as short as starvation_s
        reopened the thrash at loads past capacity).

        With a KV offload tier the door counts the running calls' blocks only, against half
        the pin budget. A pin pushed out of the pool then goes to the tier and comes back
        for a few percent of its recompute, so pins no longer need the door's protection;
        what it still bounds is how many programs run at once, past which each new
        program's calls slow every running one and the median job rises. In the simulated
        sweep (docs/benchmarks.md, "The agent sweep") this took p50 from 1.8-2.6x FCFS's to
        2.1-3.4x where FCFS thrashes on many short programs, and no cell fell under FCFS;
        the whole pin budget there lost the median at the highest load (1.57x)."""
        used = self.kv.num_blocks - self.kv.num_free_blocks
        budget = self.sessions.max_pinned
        pins_off = budget <= 0 or self.sessions.ttl_s <= 0
        if self.kv.offload is not None:
            used -= self.sessions.num_pinned
            budget //= 2

        def door_open(r: Request) -> bool:
            if (pins_off or r.session is None or r.session.calls > 1 or r.first_scheduled_time is not None
                    or not self.running or now - r.arrival_time >= self.sessions.ttl_max_s):
                return True
            need = self.kv.blocks_held(r.num_tokens)
            if need > budget or used + need <= budget:
                return True
            if not r.session.held_at_door:
                r.session.held_at_door = True
                self.sessions.stats.held_at_door += 1
            return False
        return door_open

    @staticmethod
    def _resumed_idle(req: Request) -> bool:
        """Resumed after a preemption and not sampled since: preempting it again only
        lengthens its stall."""
        return req.num_preemptions > 0 and req.num_output_tokens == req.outputs_at_admission

    def _victim(self, candidates: list[Request] | None = None) -> Request:
        """The running request (of candidates, default all) the policy preempts when the
        pool runs dry; one resumed and not sampled since only when no other is left."""
        candidates = self.running if candidates is None else candidates
        candidates = [r for r in candidates if not self._resumed_idle(r)] or candidates
        policy = self.policy
        if policy == "fcfs":
            return candidates[-1]
        order = {id(r): i for i, r in enumerate(self.running)}  # later admitted = later
        if policy == "priority":
            key = lambda r: (r.priority, r.arrival_time, order[id(r)])  # noqa: E731
        elif policy == "program":
            key = lambda r: (self._service(r), r.arrival_time, order[id(r)])  # noqa: E731
        else:
            key = lambda r: (self.tenants.counter(r.tenant), r.arrival_time, order[id(r)])  # noqa: E731
        return max(candidates, key=key)

    def _resume_overdue(self, now: float, budget: int, scheduled: dict, decisions: list[str],
                        preempted: list[str]) -> int:
        """max_stream_stall_s: bring back each preempted stream whose last token is that old,
        preempting running requests that have sampled since their admission for its blocks
        and seat; it is planned first, leaving a token of budget per running request.
        Returns the budget left."""
        bound = self.config.max_stream_stall_s
        if bound is None or not self.waiting:
            return budget
        overdue = sorted((r for r in self.waiting if r.last_token_time is not None
                          and now - r.last_token_time >= bound), key=lambda r: r.last_token_time)
        for req in overdue:
            if budget <= 0:
                break
            if _adapter_waits(req, self._adapters_full()):
                continue  # its adapter has no slot: it waits as admission would have it
            while True:
                def chunk(p):
                    return min(budget, max(1, min(req.num_tokens - p.num_tokens, budget - len(self.running))))
                prefix = self.kv.fit_prefix(req, self.kv.find_cached_prefix(req), chunk)  # noqa: B023
                n = chunk(prefix)
                if len(self.running) < self.config.max_num_seqs and self.kv.allocate(req, n, prefix) is not None:
                    break
                movable = [r for r in self.running if r.num_output_tokens > r.outputs_at_admission]
                if not movable:
                    return budget  # nobody has made progress to give way yet: it waits
                victim = self._victim(movable)
                decisions.append(f"preempt {victim.request_id} for stalled {req.request_id} "
                                 f"({now - req.last_token_time:.1f}s)")
                self._preempt(victim)
                preempted.append(victim.request_id)
            self.waiting.remove(req)
            self._admit(req, prefix)
            self.num_stall_resumptions += 1
            scheduled[req.request_id] = self._plan_entry(req, n)
            budget -= n
        return budget

    def _admit(self, req: Request, prefix) -> None:
        """A waiting request whose blocks are allocated joins the running batch."""
        if req.session is not None:
            self.sessions.call_admitted(req.session)
        req.num_computed_tokens += prefix.num_tokens
        if req.num_preemptions == 0:
            req.num_cached_tokens = prefix.num_tokens
        req.status = RequestStatus.RUNNING
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.outputs_at_admission = req.num_output_tokens
        self.running.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # -- one step -------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        admit_more = True
        if self.step_model is not None:
            # Every running request still gets its decode; prompt chunks and admissions take
            # what the target leaves. A batch whose decodes alone break it does not grow.
            budget = max(self.step_model.budget(budget), min(budget, len(self.running)))
            over = self.step_model.predict(len(self.running) + 1)
            admit_more = not self.running or over is None or over <= self.step_model.target_s
        self.last_budget = budget
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []
        now = self.clock()
        decisions: list[str] = []
        self.last_decisions = decisions
        if self.sessions.num_pinned:
            self.sessions.expire(now)
        budget = self._resume_overdue(now, budget, scheduled, decisions, preempted)

        # Decodes first (stable sort keeps admission order within each group), so a
        # long prompt chunk never stalls tokens of requests already generating.
        order = sorted(self.running, key=lambda r: _todo(r) > 1)
        drafts: dict[str, list[int]] = {}
        if self.spec is not None:
            # (A request whose last token is still being sampled has nothing to draft from.)
            decodes = [r for r in order if _todo(r) == 1 and not r.num_pending]
            # Drafts take only the budget that prompt work leaves: in a step that prompt
            # chunks would fill, each draft pushes a prompt token into a later step, which
            # costs time-to-first-token and, at c32, throughput too (docs/lab-notes.md).
            drafts = self.spec.drafts(decodes[:budget], budget - self._prompt_work(order, budget, admit_more))
        for req in order:
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in scheduled:
                continue  # preempted earlier in this loop, or resumed (planned) above
            if req.num_pending and (req.num_output_tokens + req.num_pending >= req.max_tokens
                                    or req.num_tokens + req.num_pending >= self.max_model_len):
                continue  # the token in flight is its last: it ends when that step is processed
            n = min(_todo(req), budget)
            draft = drafts.get(req.request_id)
            if draft:
                # Verifying drafts never preempts anyone: without room, or budget, it decodes.
                draft = draft[:budget - n]
                if draft and self.kv.allocate(req, n, num_lookahead=len(draft)) is not None:
                    scheduled[req.request_id] = self._plan_entry(req, n, draft)
                    budget -= n + len(draft)
                    continue
            while self.kv.allocate(req, n) is None:
                # Pinned session blocks go before any running request is preempted.
                if self.sessions.num_pinned and self.sessions.free_for(self.kv.free_blocks_taken(req, n)):
                    decisions.append(f"unpin for {req.request_id}")
                    continue
                victim = self._victim()
                decisions.append(f"preempt {victim.request_id}")
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += len(undone.token_ids)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            scheduled[req.request_id] = self._plan_entry(req, n)
            budget -= n

        # Admit waiting requests only if nobody had to be preempted for room.
        prefilling = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        reserve = None  # blocks the admitted prompts' next chunks will take (summed when first needed)
        while (not preempted and admit_more and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self._next_waiting(now)
            if req is None:
                break
            rest = req.num_tokens - req.num_computed_tokens
            prefix = self.kv.fit_prefix(req, self.kv.find_cached_prefix(req),
                                        lambda p: min(rest - p.num_tokens, budget))  # noqa: B023
            n = min(rest - prefix.num_tokens, budget)
            if not self.running and self.sessions.num_pinned:
                need = self.kv.free_blocks_taken(req, n, prefix)
                if need > self.kv.num_free_blocks and self.sessions.free_for(need):
                    # Nothing runs that could finish and make room: pins kept now only block
                    # the queue (until their TTL, minutes), so they go.
                    decisions.append(f"unpin for {req.request_id} (nothing running)")
                    continue
            # While sessions hold pins, an admission leaves a free block per running request
            # (their next blocks): else the running requests' growth would take the pins at
            # once, and admissions, not running requests, would decide which pins survive.
            if (self.sessions.num_pinned and self.kv.num_free_blocks - self.kv.free_blocks_taken(req, n, prefix)
                    < len(self.running)):
                break
            # Room for every admitted prompt to finish: a request admitted into blocks that
            # the prompts already running will need for their next chunks gets one of them
            # preempted a few steps later and its prompt recomputed (with sliding-window
            # groups, whose prompts hold more blocks than they keep, this took a 0.1 GiB
            # Gemma 3 run of 2k-token prompts from 21 preemptions to none, docs/benchmarks.md).
            # With nothing running it is admitted anyway: the pool is as free as it gets.
            if self.running and (n < req.num_tokens - req.num_computed_tokens - prefix.num_tokens or prefilling):
                chunk = self.config.max_num_batched_tokens
                if reserve is None:
                    reserve = sum(self.kv.prompt_growth(r, chunk) for r in prefilling)
                room = self.kv.num_free_blocks - reserve
                if room < max(self.kv.free_blocks_taken(req, n, prefix),
                              self.kv.peak_blocks(req.num_prompt_tokens, chunk) - len(prefix.blocks)):
                    break
            if self.kv.allocate(req, n, prefix) is None:
                break
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
                decisions.append(f"admit {req.request_id} ({self.policy})")
            self._admit(req, prefix)
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                prefilling.append(req)
                if reserve is not None:
                    reserve += self.kv.prompt_growth(req, self.config.max_num_batched_tokens)
            scheduled[req.request_id] = self._plan_entry(req, n)
            budget -= n

        entries = list(scheduled.values())
        # Offload copies wait for a step that runs (order is all they need, kv_offload.py).
        transfers = self.kv.take_transfers() if entries else []
        return StepPlan(entries, sum(len(e.token_ids) for e in entries), preempted, transfers)

    def _plan_entry(self, req: Request, n: int, draft: list[int] | None = None) -> ScheduledRequest:
        start = req.num_computed_tokens
        known = req.num_tokens  # tokens on the host; a pending one follows them
        # A request that generates nothing (max_tokens 0) needs no logits: its prompt's
        # last row predicts a token nobody asked for.
        needs_logits = start + n == known + req.num_pending and req.max_tokens > 0
        banned: list[int] = []
        if needs_logits and req.num_output_tokens + req.num_pending < req.params.min_tokens:
            banned = sorted(req.eos_token_ids | set(req.params.stop_token_ids))
        prompt_lp = None
        if req.needs_prompt_logprobs:
            # Positions already scored (before a preemption, say) are not scored again.
            lo = max(start, req.num_prompt_logprobs)
            hi = min(start + n, req.num_prompt_tokens - 1)
            if lo < hi:
                prompt_lp = (lo, hi)
        pending = start + n > known
        tokens = req.token_ids_slice(start, min(start + n, known)) + [0] * pending
        groups = self.kv.group_block_ids(req.request_id)
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=tokens + (draft or []),
            start_pos=start,
            block_ids=groups[0] if groups else self.kv.block_ids(req.request_id),
            needs_logits=needs_logits,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            banned_token_ids=banned,
            prompt_logprob_positions=prompt_lp,
            grammar=req.grammar if needs_logits else None,
            draft_token_ids=draft or [],
            pending_input=pending,
            group_block_ids=groups,
            lora=req.lora,
        )

    # -- asynchronous scheduling ----------------------------------------------
    def advance(self, plan: StepPlan) -> None:
        """A launched step's tokens count as computed now, and each request it samples
        for has a token pending, so that the next plan can be made before this step's
        tokens reach the host. Plans with drafts are never advanced (how many tokens a
        verification keeps is known only from its result)."""
        for e in plan.scheduled:
            req = self.requests[e.request_id]
            req.num_computed_tokens += len(e.token_ids)
            if e.needs_logits:
                req.num_pending += 1

    def unadvance(self, plan: StepPlan, request_ids=None) -> None:
        """advance() undone for a step that failed (for these of its requests; default
        all): its tokens were never computed, so the blocks it would have filled must not
        stay named in the prefix cache."""
        for e in plan.scheduled:
            if request_ids is not None and e.request_id not in request_ids:
                continue
            req = self.requests.get(e.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue
            req.num_computed_tokens = max(0, req.num_computed_tokens - len(e.token_ids))
            if e.needs_logits:
                req.num_pending = max(0, req.num_pending - 1)

    def preempt_all(self) -> int:
        """Preempt every running request (a weight update: their KV was computed with the
        old weights); they keep their order at the front of the queue. Returns how many."""
        running = list(self.running)
        for req in reversed(running):
            self._preempt(req)
        return len(running)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, plan: StepPlan, result: StepResult, advanced: bool = False) -> StepUpdate:
        """Account computed tokens (unless advance() did), append sampled ones, run
        token-level stop checks and free the blocks of every request that finished."""
        with_new_token: list[Request] = []
        finished: list[Request] = []
        num_new: dict[str, int] = {}
        now = self.clock()
        step_drafted = step_accepted = 0
        redo = self._failed_loads(plan, result.failed_loads) if result.failed_loads else set()
        for entry in plan.scheduled:
            req = self.requests.get(entry.request_id)
            if req is None or entry.request_id in redo:
                continue  # aborted while the step ran, or computed from a failed reload
            if req.status is not RequestStatus.RUNNING:
                # Preempted by the plan made while this step ran: its token is still its
                # own (computed from its whole context), and its recompute includes it.
                if not (advanced and entry.needs_logits and req.status is RequestStatus.PREEMPTED
                        and req.num_pending):
                    continue
            # Drafted tokens are computed only as far as they were accepted (below).
            n = len(entry.token_ids) - len(entry.draft_token_ids)
            if not advanced:
                req.num_computed_tokens += n
            req.served_tokens += n
            if req.session is not None:
                req.session.service += n
            if self.config.policy == "fair":  # VTC: prompt tokens when computed, outputs when sampled
                prompt_part = max(0, min(entry.start_pos + n, req.num_prompt_tokens) - entry.start_pos)
                self.tenants.charge(req.tenant, prompt_part, 1 if entry.needs_logits else 0)
            plp = result.prompt_logprobs.get(entry.request_id)
            if plp is not None and req.prompt_logprobs is not None:
                self._store_prompt_logprobs(req, plp)
            if not entry.needs_logits:
                if req.max_tokens == 0 and entry.start_pos + n >= req.num_tokens:
                    # Prefill-only (a prompt scored, nothing generated): done with its prompt.
                    req.status = RequestStatus.FINISHED_LENGTH
                    self._remove_finished(req)
                    finished.append(req)
                continue
            tokens = [result.sampled[entry.request_id]]
            if entry.draft_token_ids:
                tokens += result.accepted.get(entry.request_id, [])
            if advanced:
                req.num_pending -= 1
            preempted = req.status is RequestStatus.PREEMPTED
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            for r in req.siblings or (req,):
                r.last_token_time = now  # (one stream to the client, whichever child sampled)
            with_new_token.append(req)
            for i, sampled in enumerate(tokens):
                if i:
                    # The token before it was an accepted draft: its K/V was computed in
                    # this step's forward pass (for the slot it was verified in).
                    req.num_computed_tokens += 1
                    req.served_tokens += 1
                    if req.session is not None:
                        req.session.service += 1
                self._append(req, sampled)
                if req.check_stop(self.max_model_len):
                    if preempted:
                        self.waiting.remove(req)
                    self._remove_finished(req)
                    finished.append(req)
                    break
            if advanced and req.status is RequestStatus.RUNNING:
                self.kv.name_known(req)  # a block its new token completed
            if entry.draft_token_ids:
                # Accepted: the drafts it kept (up to where a stop ended it, if one did).
                step_drafted += len(entry.draft_token_ids)
                step_accepted += i
                self.spec.verified(req, len(entry.draft_token_ids), i)
            if i:
                num_new[req.request_id] = i + 1
                if self.config.policy == "fair":  # VTC: each output token, however many a step
                    self.tenants.charge(req.tenant, 0, i)
        if self.spec is not None:
            self.spec.step_done(step_drafted, step_accepted)
        return StepUpdate(with_new_token, finished, num_new)

    def _failed_loads(self, plan: StepPlan, failed: list[tuple[str, bytes, int]]) -> set[str]:
        """Reloads of this plan that failed: their blocks lose their names and their keys
        leave the tiers, and each request of the plan that holds one is preempted (its
        step is discarded; it recomputes its tokens). Returns those requests' ids."""
        block_ids = set()
        for kind, key, block_id in failed:
            self.kv.failed_load(block_id)
            self.kv.offload.failed(kind, key)
            block_ids.add(block_id)
        redo = set()
        for entry in plan.scheduled:
            req = self.requests.get(entry.request_id)
            if req is None or not self.kv.holds_any(req.request_id, block_ids):
                continue
            redo.add(req.request_id)
            req.num_pending = 0
            if req.status is RequestStatus.RUNNING:
                self._preempt(req)
        logger.warning("%d offloaded KV block(s) failed to reload; %d request(s) recompute them",
                       len(failed), len(redo))
        return redo

    def _append(self, req: Request, sampled: SampledToken) -> None:
        req.output_token_ids.append(sampled.token_id)
        if req.grammar is not None and not req.grammar.accept(sampled.token_id) \
                and sampled.token_id not in req.eos_token_ids:
            # Masked sampling only picks allowed tokens; this is a grammar engine fault.
            logger.warning("request %s: its grammar refused sampled token %d (%s); ending it",
                           req.request_id, sampled.token_id, req.grammar.error[:200])
        if req.held_grammar is not None and sampled.token_id == req.grammar_after:
            req.grammar, req.held_grammar = req.held_grammar, None  # the answer begins: so does its grammar
        if req.logprobs is not None and sampled.logprobs is not None:
            req.logprobs.append(sampled.logprobs)

    @staticmethod
    def _store_prompt_logprobs(req: Request, plp: PromptLogprobs) -> None:
        # By position: a chunk computed twice overwrites, never appends.
        for j, entry in enumerate(plp.entries):
            req.prompt_logprobs[plp.start + j + 1] = entry
        if plp.start <= req.num_prompt_logprobs:
            req.num_prompt_logprobs = max(req.num_prompt_logprobs, plp.start + len(plp.entries))

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request now (abort, or a stop string found in its text); its blocks are freed."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is not RequestStatus.RUNNING:
            self.waiting.remove(req)
        req.status = status
        self._remove_finished(req)
        return req

    def _remove_finished(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        if req.session is not None:
            # A call that ended normally pins its history for the session's next call; an
            # aborted or failed one does not.
            pin = req.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
            self.sessions.call_ended(req.session, self.kv.history(req) if pin else None, pin)
            self.num_session_calls -= 1
            req.session = None  # (ended once, whatever removes it later)
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
        if self.spec is not None:
            self.spec.request_finished(req)
