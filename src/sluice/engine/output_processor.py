"""OutputProcessor: detokenizes new tokens, finds stop strings, builds RequestOutputs.

Stop strings need text, so they are found here; a request that hits one is ended in the
scheduler the same step (its blocks are freed before the next step). While a request
runs, the last len(longest stop) - 1 characters are held back, so a stop string that is
still forming is never shown to a streaming client.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sluice.core.scheduler import Scheduler, StepUpdate
from sluice.outputs import CompletionOutput, RequestOutput, RequestTimes
from sluice.request import Request, RequestStatus, logprob_dict
from sluice.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _SampleState:
    index: int
    parent_id: str
    detok: IncrementalDetokenizer
    text: str = ""
    holdback: int = 0
    request: Request | None = None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    finished_children: set[str] = field(default_factory=set)
    prompt_logprobs: list | None = None   # complete and decoded; never changes after
    error: str | None = None              # why the engine ended it, if it failed


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler):
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.samples: dict[str, _SampleState] = {}
        self.parents: dict[str, _ParentState] = {}
        self._aborted: list[Request] = []

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            children: list[Request]) -> None:
        self.parents[request_id] = _ParentState(request_id, prompt, prompt_token_ids,
                                                [c.request_id for c in children])
        # n > 1 samples share one prompt: the first computes and reports its logprobs; the
        # others drop theirs, so they neither score the prompt nor refuse its cached blocks.
        for child in children[1:]:
            child.prompt_logprobs = None
        for i, child in enumerate(children):
            holdback = max((len(s) for s in child.params.stop), default=1) - 1
            self.samples[child.request_id] = _SampleState(
                i, request_id, IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                                      child.params.skip_special_tokens),
                holdback=holdback, request=child)

    def children_of(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.child_ids) if parent else []

    def has_pending(self) -> bool:
        return bool(self._aborted)

    def mark_aborted(self, requests: list[Request]) -> None:
        self._aborted.extend(requests)

    def parents_of(self, request_ids) -> list[str]:
        """The parent request ids of these sample ids (each once, in order)."""
        return list(dict.fromkeys(self.samples[r].parent_id for r in request_ids if r in self.samples))

    def fail(self, parent_ids: list[str], error: str) -> list[RequestOutput]:
        """Final outputs for requests the engine ended with an error (their samples are
        already finished in the scheduler)."""
        outs = []
        for pid in parent_ids:
            if pid in self.parents:
                self.parents[pid].error = error
                outs.append(self._make_output(pid))
        return outs

    def process(self, update: StepUpdate) -> list[RequestOutput]:
        touched: dict[str, None] = {}
        for req in update.with_new_token:
            state = self.samples[req.request_id]
            self._detokenize(req, state, update.num_new_tokens.get(req.request_id, 1))
            touched[state.parent_id] = None
        for req in update.finished:  # a prefill-only request ends without a new token
            if req.request_id in self.samples:
                touched.setdefault(self.samples[req.request_id].parent_id, None)
        for req in self._aborted:
            if req.request_id in self.samples:
                touched[self.samples[req.request_id].parent_id] = None
        self._aborted.clear()
        return [self._make_output(pid) for pid in touched]

    def _detokenize(self, req: Request, state: _SampleState, num_new: int = 1) -> None:
        """The request's last num_new tokens (more than one when drafts were accepted),
        one at a time: a stop string found at one of them ends the request there, and the
        tokens after it are dropped, as if they had never been sampled."""
        out = req.output_token_ids
        first = len(out) - num_new
        stops = req.params.stop
        longest = max((len(s) for s in stops), default=0)
        for i in range(first, len(out)):
            last = i == len(out) - 1
            old_len = len(state.text)
            # A stop token (EOS or a stop id) ends the text; it is in token_ids but not shown.
            stopped_by_token = last and req.ended_by_token
            if not stopped_by_token:
                state.text += state.detok.add(out[i])
            if last and req.is_finished() and not stopped_by_token:
                state.text += state.detok.flush()
            if req.logprobs:
                row = req.logprobs[i]
                req.logprobs[i] = logprob_dict(row, self.tokenizer.token_texts(row[0]))
            if not stops or stopped_by_token:
                continue
            # A new match must end in the new text, so it starts at most len(stop) - 1 before it.
            search_from = max(0, old_len - longest + 1)
            hit = None
            for s in stops:
                pos = state.text.find(s, search_from)
                if pos != -1 and (hit is None or pos < hit[0]):
                    hit = (pos, s)
            if hit is None:
                continue
            state.text = state.text[:hit[0] + (len(hit[1]) if req.params.include_stop_str_in_output else 0)]
            req.stop_reason = hit[1]
            if not last:
                del out[i + 1:]
                if req.logprobs is not None:
                    del req.logprobs[i + 1:]
                req.ended_by_token = False
                # Computed tokens past the new end are not its (a pinned session keeps the rest).
                req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
            if req.is_finished():
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
            return

    def _prompt_logprobs(self, parent: _ParentState, reqs: list[Request]) -> list | None:
        """The prompt's logprobs, from the one sample that computes them (the first); once
        complete they are decoded once and the same list is reported from then on."""
        if parent.prompt_logprobs is not None:
            return parent.prompt_logprobs
        src = next((r for r in reqs if r.prompt_logprobs is not None), None)
        if src is None:
            return None
        entries = src.prompt_logprobs
        for j, entry in enumerate(entries):
            if isinstance(entry, tuple):  # the runner's LogprobRow, not yet made a dict
                entries[j] = logprob_dict(entry, self.tokenizer.token_texts(entry[0]))
        out = list(entries)
        if not src.needs_prompt_logprobs:
            parent.prompt_logprobs = out
        return out  # partial (None where not computed) only if aborted during the prompt

    def _make_output(self, parent_id: str) -> RequestOutput:
        parent = self.parents[parent_id]
        outputs = []
        for cid in parent.child_ids:
            s = self.samples[cid]
            req = s.request
            text = s.text
            if not req.is_finished() and s.holdback:
                text = text[:max(0, len(text) - s.holdback)]
            outputs.append(CompletionOutput(
                index=s.index, text=text, token_ids=list(req.output_token_ids),
                finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                logprobs=list(req.logprobs) if req.logprobs is not None else None))
        finished = all(o.finished for o in outputs)
        reqs = [self.samples[cid].request for cid in parent.child_ids]
        times = RequestTimes(
            arrival=min(r.arrival_time for r in reqs),
            first_scheduled=min((r.first_scheduled_time for r in reqs if r.first_scheduled_time), default=None),
            first_token=min((r.first_token_time for r in reqs if r.first_token_time), default=None))
        out = RequestOutput(parent_id, parent.prompt, parent.prompt_token_ids, outputs, finished, times,
                            num_cached_tokens=max(r.num_cached_tokens for r in reqs),
                            prompt_logprobs=self._prompt_logprobs(parent, reqs), error=parent.error,
                            tenant=reqs[0].tenant)
        if finished:
            for cid in parent.child_ids:
                self.samples.pop(cid, None)
            self.parents.pop(parent_id, None)
        return out
