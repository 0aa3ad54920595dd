"""Scheduler: iteration-level scheduling under one token budget per step.

There is no prefill phase. Every request has tokens (prompt + outputs) and a count of
computed tokens; each step the scheduler lets computed tokens catch up, decodes first,
then prefill chunks of running requests, then new admissions from the waiting queue,
all under `max_num_batched_tokens`. A prompt bigger than what is left of the budget is
split over steps (chunked prefill). When the KV pool runs dry, the most recently
admitted running request is preempted: its blocks are freed and it is requeued at the
front, to be recomputed from its tokens later.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from sluice.config import SchedulerConfig
from sluice.core.kv_cache_manager import KVCacheManager
from sluice.request import Logprob, Request, RequestStatus
from sluice.sampling_params import SamplingParams


@dataclass
class ScheduledRequest:
    """One request's share of a step: everything the runner needs, nothing more."""
    request_id: str
    token_ids: list[int]            # tokens to compute this step
    start_pos: int                  # position of token_ids[0] (= tokens already computed)
    block_ids: list[int]
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


@dataclass
class StepPlan:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[str] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    # Present when the request asked for logprobs: (token_id, logprob, rank) with the
    # chosen token first, then the top-N.
    logprobs: list[tuple[int, float, int]] | None = None


@dataclass
class PromptLogprobs:
    """Prompt logprobs from one step: entries[j] scores prompt token start + j + 1, as
    (token_id, logprob, rank) with the prompt token first, then the top-N."""
    start: int
    entries: list[list[tuple[int, float, int]]]


@dataclass
class StepResult:
    sampled: dict[str, SampledToken]
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


@dataclass
class StepUpdate:
    with_new_token: list[Request]   # requests that got a token this step
    finished: list[Request]         # requests that left the batch this step


class Scheduler:
    def reset_prefix_cache(self) -> int:
        return self.kv.reset_prefix_cache()

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int):
        if config.max_num_batched_tokens is None:
            raise ValueError("max_num_batched_tokens is unset: EngineConfig.validate() picks the device's default")
        self.config = config
        self.kv = kv
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # -- queues ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

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
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[str] = []

        # Decodes first (stable sort keeps admission order within each group), so a
        # long prompt chunk never stalls tokens of requests already generating.
        for req in sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate(req, n) is None:
                victim = self.running[-1]
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
        while (not preempted and self.waiting and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            prefix = self.kv.find_cached_prefix(req)
            n = min(req.num_tokens - req.num_computed_tokens - prefix.num_tokens, budget)
            if self.kv.allocate(req, n, prefix) is None:
                break
            self.waiting.popleft()
            req.num_computed_tokens += prefix.num_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = prefix.num_tokens
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            scheduled[req.request_id] = self._plan_entry(req, n)
            budget -= n

        entries = list(scheduled.values())
        return StepPlan(entries, sum(len(e.token_ids) for e in entries), preempted)

    def _plan_entry(self, req: Request, n: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        needs_logits = start + n == req.num_tokens
        banned: list[int] = []
        if needs_logits and req.num_output_tokens < req.params.min_tokens:
            banned = sorted(req.eos_token_ids | set(req.params.stop_token_ids))
        prompt_lp = None
        if req.needs_prompt_logprobs:
            # Positions already scored (before a preemption, say) are not scored again.
            lo = max(start, req.num_prompt_logprobs)
            hi = min(start + n, req.num_prompt_tokens - 1)
            if lo < hi:
                prompt_lp = (lo, hi)
        return ScheduledRequest(
            request_id=req.request_id,
            token_ids=req.token_ids_slice(start, start + n),
            start_pos=start,
            block_ids=self.kv.block_ids(req.request_id),
            needs_logits=needs_logits,
            params=req.params,
            prompt_token_ids=req.prompt_token_ids,
            output_token_ids=req.output_token_ids,
            banned_token_ids=banned,
            prompt_logprob_positions=prompt_lp,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, plan: StepPlan, result: StepResult) -> StepUpdate:
        """Account computed tokens, append sampled ones, run token-level stop checks and
        free the blocks of every request that finished."""
        with_new_token: list[Request] = []
        finished: list[Request] = []
        for entry in plan.scheduled:
            req = self.requests.get(entry.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens += len(entry.token_ids)
            plp = result.prompt_logprobs.get(entry.request_id)
            if plp is not None and req.prompt_logprobs is not None:
                self._store_prompt_logprobs(req, plp)
            if not entry.needs_logits:
                continue
            sampled = result.sampled[entry.request_id]
            req.output_token_ids.append(sampled.token_id)
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
            if req.logprobs is not None and sampled.logprobs is not None:
                req.logprobs.append({tid: Logprob(lp, rank) for tid, lp, rank in sampled.logprobs})
            with_new_token.append(req)
            if req.check_stop(self.max_model_len):
                self._remove_finished(req)
                finished.append(req)
        return StepUpdate(with_new_token, finished)

    @staticmethod
    def _store_prompt_logprobs(req: Request, plp: PromptLogprobs) -> None:
        # By position: a chunk computed twice overwrites, never appends.
        for j, entry in enumerate(plp.entries):
            req.prompt_logprobs[plp.start + j + 1] = {tid: Logprob(lp, rank) for tid, lp, rank in entry}
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
        self.kv.free(req)
        self.requests.pop(req.request_id, None)
